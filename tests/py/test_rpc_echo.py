"""The RPC layer against a real gRPC client: Python grpcio stubs generated from proto/ with
grpcio-tools call chunkserve-echo-server (tests/rpc/echo_server.c, the C layer serving
chunkserve.v1.Echo) as a separate process on loopback.

Checks: every proto in proto/ compiles for Python; unary and streaming round trips with
metadata; cancellation; deadlines; unknown methods answered UNIMPLEMENTED at once; oversized
and malformed requests; 32 concurrent streams; SIGTERM with 16 streams in flight exits 0 and
ends every stream with a status.  Timing bounds are generous: they catch hangs only.
"""
from __future__ import annotations

import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_tools.protoc")  # stubs: conftest.proto_modules

UNARY = "/chunkserve.v1.Echo/Unary"


@pytest.fixture(scope="module")
def stubs(proto_modules):
    return proto_modules


def start_server(bin_dir: Path, *args):
    exe = bin_dir / "chunkserve-echo-server"
    if not exe.is_file():
        pytest.skip(f"{exe} not built")
    proc = subprocess.Popen([str(exe), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = proc.stdout.readline().decode()
    assert line.startswith("port "), f"unexpected first line {line!r}; stderr: {proc.stderr.read()!r}"
    return proc, int(line.split()[1])


def stop_server(proc, timeout=10.0):
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"echo server did not exit within {timeout}s of SIGTERM")
    assert rc == 0, f"echo server exit {rc}: {proc.stderr.read().decode()[-2000:]}"


@pytest.fixture(scope="module")
def server(bin_dir):
    proc, port = start_server(bin_dir, "--max-recv-bytes", "65536")
    yield port
    stop_server(proc)


@pytest.fixture
def stub(server, stubs):
    ch = grpc.insecure_channel(f"127.0.0.1:{server}")
    yield ch, stubs["echo_pb2_grpc"].EchoStub(ch), stubs["echo_pb2"]
    ch.close()


def test_protos_generate(stubs):
    gen = stubs["generation_pb2"]
    req = gen.GenerateRequest(model="m", prompt="hi", sampling=gen.SamplingParams(max_tokens=3))
    assert req.WhichOneof("input") == "prompt"
    assert gen.FinishReason.Name(2) == "FINISH_REASON_LENGTH"
    cl = stubs["cluster_pb2"]
    assert cl.DecodeResponse(admitted=cl.DecodeAdmitted(transfer_id=7)).WhichOneof("event") == "admitted"


def test_unary_round_trip(stub):
    _, s, pb = stub
    resp, call = s.Unary.with_call(pb.EchoRequest(payload=b"hello"), timeout=5,
                                   metadata=[("x-request-id", "py-1")])
    assert resp.payload == b"hello"
    assert dict(call.initial_metadata()).get("x-request-id") == "py-1"
    deadline_ms = int(dict(call.trailing_metadata())["x-deadline-ms"])
    assert 0 < deadline_ms <= 5100  # grpc-timeout is rounded up on the wire


def test_stream_in_order(stub):
    _, s, pb = stub
    seqs = [m.seq for m in s.Stream(pb.EchoRequest(payload=b"t", count=2000), timeout=30)]
    assert seqs == list(range(2000))


def test_cancel_mid_stream(stub):
    _, s, pb = stub
    it = s.Stream(pb.EchoRequest(payload=b"t", count=10**9), timeout=30)
    for i, _ in enumerate(it):
        if i == 10:
            it.cancel()
            break
    with pytest.raises(grpc.RpcError) as e:
        next(it)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert s.Unary(pb.EchoRequest(payload=b"ok"), timeout=5).payload == b"ok"


def test_deadline(stub):
    _, s, pb = stub
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        s.Unary(pb.EchoRequest(delay_ms=30000), timeout=0.3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 5


def test_unknown_method_at_once(stub):
    ch, _, _ = stub
    for method in ("/chunkserve.v1.Echo/Nope", "/no.such.Service/Call"):
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(method)(b"", timeout=30)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert time.monotonic() - t0 < 5, "unknown method must not wait for its deadline"


def test_too_large_and_malformed(stub):
    ch, s, pb = stub
    with pytest.raises(grpc.RpcError) as e:
        s.Unary(pb.EchoRequest(payload=b"x" * 100_000), timeout=5)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as e:
        ch.unary_unary(UNARY)(b"\xff\xff\xff\xff\x0f", timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "EchoRequest" in e.value.details()
    assert s.Unary(pb.EchoRequest(payload=b"still"), timeout=5).payload == b"still"


def test_health_check_and_watch(stub, stubs):
    ch, _, _ = stub
    h = stubs["health_pb2"]
    check = ch.unary_unary("/grpc.health.v1.Health/Check",
                           request_serializer=h.HealthCheckRequest.SerializeToString,
                           response_deserializer=h.HealthCheckResponse.FromString)
    watch = ch.unary_stream("/grpc.health.v1.Health/Watch",
                            request_serializer=h.HealthCheckRequest.SerializeToString,
                            response_deserializer=h.HealthCheckResponse.FromString)
    assert check(h.HealthCheckRequest(service=""), timeout=5).status == h.HealthCheckResponse.SERVING
    assert check(h.HealthCheckRequest(service="chunkserve.v1.Echo"), timeout=5).status == \
        h.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        check(h.HealthCheckRequest(service="nope"), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    it = watch(h.HealthCheckRequest(service="nope"), timeout=10)
    assert next(it).status == h.HealthCheckResponse.SERVICE_UNKNOWN
    it.cancel()


def test_random_bytes_burst(stub):
    """1,000 random or truncated requests: each gets a status, the server keeps serving."""
    ch, s, pb = stub
    raw = ch.unary_unary(UNARY)
    rng = random.Random(5)
    codes = set()
    good = pb.EchoRequest(payload=b"abc", count=3).SerializeToString()
    for i in range(1000):
        if i % 2:
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:
            body = good[:rng.randrange(len(good))] + bytes([rng.randrange(256)])
        try:
            raw(body, timeout=5)
            codes.add("OK")
        except grpc.RpcError as e:
            codes.add(e.code().name)
    assert codes <= {"OK", "INVALID_ARGUMENT"}, codes
    assert "INVALID_ARGUMENT" in codes
    assert s.Unary(pb.EchoRequest(payload=b"alive"), timeout=5).payload == b"alive"


def test_32_concurrent_streams(stub):
    _, s, pb = stub
    results = [None] * 32

    def run(i):
        results[i] = [m.seq for m in s.Stream(pb.EchoRequest(payload=b"%d" % i, count=200,
                                                             interval_ms=1), timeout=60)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r == list(range(200)) for r in results)


def test_sigterm_with_streams_in_flight(bin_dir, stubs):
    proc, port = start_server(bin_dir, "--grace-ms", "500")
    pb = stubs["echo_pb2"]
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    s = stubs["echo_pb2_grpc"].EchoStub(ch)
    started = threading.Barrier(17)
    outcomes = [None] * 16

    def run(i):
        got = 0
        try:
            for _ in s.Stream(pb.EchoRequest(payload=b"t", count=10**9, interval_ms=5), timeout=60):
                got += 1
                if got == 3:
                    started.wait(30)
            outcomes[i] = "OK"
        except grpc.RpcError as e:
            outcomes[i] = e.code().name

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    started.wait(30)
    t0 = time.monotonic()
    stop_server(proc, timeout=10)
    assert time.monotonic() - t0 < 5
    for t in threads:
        t.join(30)
    ch.close()
    assert all(o in ("UNAVAILABLE", "CANCELLED") for o in outcomes), outcomes


def h2_connect(port: int):
    """A raw HTTP/2 client connection (h2): returns (socket, connection, the server's
    SETTINGS as a dict)."""
    import h2.config
    import h2.connection
    import h2.events
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    t_end = time.monotonic() + 5
    while time.monotonic() < t_end:
        for ev in conn.receive_data(sock.recv(65536)):
            if isinstance(ev, h2.events.RemoteSettingsChanged):
                sock.sendall(conn.data_to_send())
                return sock, conn, {k: v.new_value for k, v in ev.changed_settings.items()}
    pytest.fail("no SETTINGS from the server")


def h2_wait_goaway(sock, conn, timeout: float):
    """Seconds until the server sends GOAWAY (or closes the connection)."""
    import h2.events
    import h2.exceptions
    t0 = time.monotonic()
    sock.settimeout(timeout)
    while True:
        data = sock.recv(65536)
        if not data:
            return time.monotonic() - t0
        try:
            events = conn.receive_data(data)
        except h2.exceptions.ProtocolError:  # frames after the GOAWAY in the same read
            return time.monotonic() - t0
        if any(isinstance(ev, h2.events.ConnectionTerminated) for ev in events):
            return time.monotonic() - t0
        sock.sendall(conn.data_to_send())  # ping acks


def test_connection_limits(bin_dir):
    """cs_rpc_limits on the wire: the server announces its stream cap in SETTINGS (4096
    unless set), sends GOAWAY to a connection idle for --idle-ms, and to one older than
    --age-ms even with idling turned off."""
    import h2.settings
    proc, port = start_server(bin_dir, "--max-streams", "7", "--idle-ms", "600")
    try:
        sock, conn, settings = h2_connect(port)
        assert settings.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS) == 7
        waited = h2_wait_goaway(sock, conn, 10)
        assert 0.3 < waited < 5, waited
        sock.close()
    finally:
        stop_server(proc)
    proc, port = start_server(bin_dir, "--age-ms", "700", "--age-grace-ms", "300", "--idle-ms", "-1")
    try:
        sock, conn, _ = h2_connect(port)
        waited = h2_wait_goaway(sock, conn, 10)
        assert 0.3 < waited < 5, waited
        sock.close()
        sock, conn, settings = h2_connect(port)
        assert settings.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS) == 4096
        sock.close()
    finally:
        stop_server(proc)
