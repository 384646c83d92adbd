"""Scripted attackers against every port of a cluster that has a cluster secret
(issue 17; docs/security.md): each test says what must not happen, checks it, and then
that a canary request still succeeds and that every worker's KV pages are free again.

The cluster: one prefill and one decode worker behind the router on the tiny model, all
with --cluster-secret; the router prefills remotely from the first token
(--local-prefill-threshold=1), so every canary crosses the KV link; the prefill worker
finds its decode pool by DNS (--decode-dns=localhost:port).  Timing bounds catch
hangs only.
"""
from __future__ import annotations

import itertools
import os
import resource
import socket
import struct
import threading
import time
import urllib.request

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_tools.protoc")

from cluster_harness import (Cluster, Proc, generate, make_tiny, metric, rpc_token,  # noqa: E402
                             wait_for)

pytestmark = pytest.mark.cluster

SECRET = "hostile-test-secret-0123456789"
LEASE_MS = 3000  # the decode worker's --lease-ms: the most any caller's lease gets
ROUTER_GRPC_MIB = 64  # the router's --grpc-memory-mib: what its gRPC transport may buffer


@pytest.fixture(scope="module")
def pb(proto_modules):
    return type("PB", (), proto_modules)


@pytest.fixture(scope="module")
def cl(bin_dir, pb, tmp_path_factory):
    if not (bin_dir / "chunkserve-mktiny").is_file():
        pytest.skip("chunkserve-mktiny not built")
    model = make_tiny(bin_dir, tmp_path_factory.mktemp("tiny"))
    c = Cluster(bin_dir, model, pb, n_prefill=1, n_decode=1, secret=SECRET, kv_cache_mib=64,
                router_args=["--local-prefill-threshold=1", f"--grpc-memory-mib={ROUTER_GRPC_MIB}"],
                decode_args=[f"--lease-ms={LEASE_MS}"], prefill_knows_decode="dns")
    c.model_path = model
    yield c
    c.stop()


def canary(cl, pb, n=3):
    """n requests through the router, each over the KV link: all finish with 8 tokens."""
    g = pb.generation_pb2
    for i in range(n):
        ids, _, finish, _ = generate(cl.stub, g, ids=[(7 * i + j) % 300 + 1 for j in range(40)],
                                     max_tokens=8, ignore_eos=True, timeout=60)
        assert len(ids) == 8 and finish == g.FINISH_REASON_LENGTH


def pages_free(cl):
    cl.wait_idle(timeout=30)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def worker_calls(pb):
    c, g = pb.cluster_pb2, pb.generation_pb2
    return {
        "GetStatus": lambda st, md: st.GetStatus(c.WorkerStatusRequest(), timeout=10, metadata=md),
        "Cancel": lambda st, md: st.Cancel(c.CancelRequest(transfer_id=1), timeout=10, metadata=md),
        "Decode": lambda st, md: list(st.Decode(c.DecodeRequest(
            request_id="x", transfer_id=99, token_ids=[5] * 40, num_prompt_tokens=40,
            sampling=g.SamplingParams(max_tokens=1), lease_ms=2**31 - 1), timeout=10,
            metadata=md)),
        "Prefill": lambda st, md: st.Prefill(c.PrefillRequest(
            request_id="x", transfer_id=99, token_ids=[5] * 40, num_prompt_tokens=40,
            kv_endpoint="127.0.0.1:9", decode_worker_id="d"), timeout=10, metadata=md),
    }


def test_worker_calls_without_the_secret_are_refused(cl, pb):
    """Every Worker method of both workers answers UNAUTHENTICATED to a caller without the
    cluster's token or with a wrong one (a token of another secret), before looking at the
    request: no page is reserved, no connection is made to the kv_endpoint it names."""
    wrong = rpc_token("another-secret-of-16+bytes")
    for p in cl.prefill + cl.decode:
        before = p.metric("chunkserve:rpc_unauthenticated_total")
        stub = cl.worker_stub(p)
        own = "Prefill" if p in cl.prefill else "Decode"
        for name, call in worker_calls(pb).items():
            if name in ("Prefill", "Decode") and name != own:
                continue  # the other role's method: UNIMPLEMENTED
            for md in ([], wrong, [("x-chunkserve-token", "0" * 64)]):
                with pytest.raises(grpc.RpcError) as e:
                    call(stub, md)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (p.name, name)
                assert "cluster" in e.value.details()
        assert p.metric("chunkserve:rpc_unauthenticated_total") - before == 9
        # the token opens the door
        s = stub.GetStatus(pb.cluster_pb2.WorkerStatusRequest(), timeout=10,
                           metadata=rpc_token(SECRET))
        assert s.ready
    pages_free(cl)
    canary(cl, pb)
    pages_free(cl)


def test_a_huge_lease_is_clamped_to_the_workers_maximum(cl, pb):
    """A caller with the token asks the decode worker to hold pages for 2^31-1 ms and never
    sends the KV: the reservation ends at the worker's --lease-ms, its pages free."""
    c, g = pb.cluster_pb2, pb.generation_pb2
    stub = cl.worker_stub(cl.decode[0])
    t0 = time.monotonic()
    call = stub.Decode(c.DecodeRequest(
        request_id="hold", transfer_id=4242, token_ids=[9] * 64, num_prompt_tokens=64,
        sampling=g.SamplingParams(max_tokens=1), local_prefill=False, lease_ms=2**31 - 1),
        timeout=120, metadata=rpc_token(SECRET))
    first = next(call)
    assert first.WhichOneof("event") == "admitted"
    assert cl.status(cl.decode[0]).kv_pages_free < cl.status(cl.decode[0]).kv_pages_total
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    took = time.monotonic() - t0
    assert "lease" in e.value.details(), e.value.details()
    assert took < LEASE_MS / 1000 + 30, took  # not 2^31 ms
    pages_free(cl)
    canary(cl, pb)


def test_request_id_is_bounded_and_printable(cl, pb):
    """request_id longer than 128 bytes, with a newline (log injection) or of 4 MiB is
    refused (INVALID_ARGUMENT; 4 MiB may already exceed the message limit: RESOURCE_EXHAUSTED);
    128 printable bytes are fine; the log never shows the injected line."""
    g = pb.generation_pb2

    def gen(rid):
        return list(cl.stub.Generate(g.GenerateRequest(
            request_id=rid, token_ids=g.TokenIds(ids=[1, 2, 3]),
            sampling=g.SamplingParams(max_tokens=2)), timeout=60))

    for rid, codes in (("a" * 129, {grpc.StatusCode.INVALID_ARGUMENT}),
                       ("ok\nINJECTED-LOG-LINE", {grpc.StatusCode.INVALID_ARGUMENT}),
                       ("sp ace", {grpc.StatusCode.INVALID_ARGUMENT}),
                       ("z" * (4 << 20), {grpc.StatusCode.INVALID_ARGUMENT,
                                          grpc.StatusCode.RESOURCE_EXHAUSTED})):
        with pytest.raises(grpc.RpcError) as e:
            gen(rid)
        assert e.value.code() in codes, (len(rid), e.value.code())
        if e.value.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert "request_id" in e.value.details()
    assert gen("r" * 128)[-1].finish_reason
    assert "INJECTED-LOG-LINE" not in cl.router.stderr()
    pages_free(cl)
    canary(cl, pb)


def test_detokenize_of_a_million_ids_is_refused_with_bounded_memory(cl, pb):
    """Detokenize takes at most the context's worth of ids: 1M ids are refused and the
    router's memory stays bounded."""
    g = pb.generation_pb2
    rss0 = rss_kib(cl.router.proc.pid)
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as e:
            cl.stub.Detokenize(g.DetokenizeRequest(ids=[5] * 1_000_000), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "context" in e.value.details()
    assert rss_kib(cl.router.proc.pid) - rss0 < 200 * 1024
    assert cl.stub.Detokenize(g.DetokenizeRequest(ids=[5] * 10), timeout=10).text is not None
    canary(cl, pb, n=1)


def test_pre_hello_connections_cannot_block_the_kv_port(cl, pb):
    """300 raw connections to the decode worker's KV port (idle, garbage instead of a HELLO
    header, a byte every half second) while real transfers complete: pre-HELLO connections
    are capped (the oldest closed first) and must send HELLO within a deadline; a garbage
    header closes its connection before any payload is read.  The prefill worker restarts
    in the middle of the flood, so its new channel has to get through."""
    host, port = cl.status(cl.decode[0]).kv_endpoint.rsplit(":", 1)
    socks, stop = [], threading.Event()
    for i in range(300):
        s = socket.create_connection((host, int(port)), timeout=5)
        if i % 3 == 1:
            s.sendall(os.urandom(64))  # not a HELLO header
        socks.append(s)

    def drip():
        while not stop.is_set():
            for s in socks[2::3]:
                try:
                    s.send(b"C")
                except OSError:
                    pass
            time.sleep(0.5)

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    try:
        # a restarted prefill worker opens its KV channel in the middle of the flood
        p = cl.prefill[0]
        assert p.stop() == 0
        p.start(port=p.port)
        cl.wait_usable(1, 1)
        canary(cl, pb, n=4)
    finally:
        stop.set()
        t.join()
    # the receiver closed them all: evicted, refused, or past the HELLO deadline
    deadline = time.monotonic() + 20
    open_left = socks
    while open_left and time.monotonic() < deadline:
        still = []
        for s in open_left:
            s.settimeout(0.01)
            try:
                if s.recv(1 << 16) == b"":
                    continue
            except (ConnectionResetError, BrokenPipeError):
                continue
            except (socket.timeout, BlockingIOError):
                pass
            still.append(s)
        open_left = still
        time.sleep(0.2)
    assert not open_left, f"{len(open_left)} pre-HELLO connections still open"
    for s in socks:
        s.close()
    pages_free(cl)
    canary(cl, pb, n=1)


def test_slowloris_on_an_ops_port_leaves_healthz_answering(cl, pb):
    """1,100 sockets on the decode worker's ops port, each sending a request head one byte
    at a time: the oldest unanswered connections make room, so /healthz keeps answering
    (each probe within a second)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"the file limit ({hard}) is below 1,400")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    http = cl.decode[0].http
    host, port = http.split("//")[1].rsplit(":", 1)
    socks = []
    try:
        for _ in range(1100):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET /healthz HTTP/1.1\r\nX-Slow: ")
            socks.append(s)
        for _ in range(5):
            for s in socks[::50]:
                try:
                    s.send(b"a")
                except OSError:
                    pass
            t0 = time.monotonic()
            with urllib.request.urlopen(http + "/healthz", timeout=5) as r:
                assert r.status == 200
            assert time.monotonic() - t0 < 1.0
    finally:
        for s in socks:
            s.close()
    canary(cl, pb, n=1)
    pages_free(cl)


# ------------------------------------------------------------------ raw KV frames
KV_MAGIC, KV_VERSION = 0x564B5343, 5  # kvx/src/kvx_wire.h
HELLO, HELLO_ACK, PAGES, CHALLENGE, AUTH = 1, 2, 3, 11, 12


def kv_frame(ftype, epoch, xfer, fingerprint, payload=b"", first=0, n_pages=0):
    """One KV frame (kvx/src/kvx_wire.h): the 64-byte header, its XXH32, the payload."""
    import xxhash
    def hdr(sum32):
        return struct.pack("<IHHIIQQIIQQQ", KV_MAGIC, KV_VERSION, ftype, 0, sum32, epoch, xfer,
                           first, n_pages, fingerprint, len(payload), 0)
    return hdr(xxhash.xxh32_intdigest(hdr(0))) + payload


def kv_layout(fingerprint, model_fp):
    """The 32-byte layout whose XXH64 (with the model's fingerprint, public in ListModels)
    is the status's fingerprint: an attacker needs no secret for it (a small search over
    plausible tiny-model shapes)."""
    import xxhash
    for nl, kh, hd, dt, wt in itertools.product(range(1, 9), range(1, 9), (8, 16, 32, 64),
                                                (0, 1, 2), (0, 1)):
        pb = nl * kh * hd * 2 * 16 * (4 if dt == 0 else 2)
        b = struct.pack("<6IQ", nl, kh, hd, dt, 16, wt, pb)
        if xxhash.xxh64_intdigest(b + struct.pack("<Q", model_fp), seed=KV_MAGIC) == fingerprint:
            return b, pb
    pytest.fail("no layout matches the fingerprint")


def kv_read(s):
    """(type, payload) of the next frame, or None when the peer closed the connection."""
    buf = b""
    try:
        while len(buf) < 64:
            d = s.recv(64 - len(buf))
            if not d:
                return None
            buf += d
        n = struct.unpack_from("<Q", buf, 48)[0]
        pl = b""
        while len(pl) < n:
            d = s.recv(n - len(pl))
            if not d:
                return None
            pl += d
    except (ConnectionResetError, socket.timeout):
        return None
    return struct.unpack_from("<H", buf, 6)[0], pl


def test_forged_hello_and_pages_into_a_live_reservation(cl, pb):
    """A live reservation on the decode worker (a held Decode call). An attacker who knows
    the layout sends a HELLO naming a prefill worker with epoch UINT64_MAX, gets the
    CHALLENGE, answers with a proof it cannot make, then pushes PAGES for the reservation:
    the receiver refuses the AUTH and closes the connection before any page is taken; the
    real prefill worker is not fenced (its transfers keep completing); the reservation's
    pages are freed at its lease."""
    c, g = pb.cluster_pb2, pb.generation_pb2
    st = cl.status(cl.decode[0])
    model_fp = cl.stub.ListModels(pb.generation_pb2.ListModelsRequest(), timeout=10).models[0].fingerprint
    layout, page_bytes = kv_layout(st.kv_layout_fingerprint, model_fp)
    host, port = st.kv_endpoint.rsplit(":", 1)
    before = cl.decode[0].metric("chunkserve:kv_protocol_errors_total")
    call = cl.worker_stub(cl.decode[0]).Decode(c.DecodeRequest(
        request_id="victim", transfer_id=777, token_ids=[11] * 32, num_prompt_tokens=32,
        sampling=g.SamplingParams(max_tokens=1), local_prefill=False, lease_ms=LEASE_MS),
        timeout=60, metadata=rpc_token(SECRET))
    assert next(call).WhichOneof("event") == "admitted"
    fp = st.kv_layout_fingerprint
    assert cl.status(cl.prefill[0]).kv_sender  # the name the router tells the decode side
    for name in (b"prefill-0", cl.status(cl.prefill[0]).worker_id.encode()):
        s = socket.create_connection((host, int(port)), timeout=5)
        # layout, name, nonce, the payload byte (0: TCP) and 7 zero bytes
        hello = layout + name[:63].ljust(64, b"\0") + os.urandom(16) + bytes(8)
        s.sendall(kv_frame(HELLO, 2**64 - 1, 0, fp, hello))
        reply = kv_read(s)
        assert reply is not None and reply[0] == CHALLENGE, reply
        s.sendall(kv_frame(AUTH, 2**64 - 1, 0, fp, os.urandom(32)))
        try:
            s.sendall(kv_frame(PAGES, 2**64 - 1, 777, fp, b"\x7f" * (2 * page_bytes),
                               n_pages=2))
        except OSError:
            pass
        reply = kv_read(s)
        assert reply is None or reply[0] == HELLO_ACK  # the refusal, then the close
        if reply is not None:
            assert kv_read(s) is None
        s.close()
    assert cl.decode[0].metric("chunkserve:kv_protocol_errors_total") - before >= 2
    canary(cl, pb, n=3)  # the real sender still delivers
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert "lease" in e.value.details()
    assert "authentication failed" in cl.decode[0].stderr()
    assert "reconnected" not in cl.decode[0].stderr()
    pages_free(cl)


def test_two_models_of_different_seeds_refuse_each_other(cl, pb, bin_dir, tmp_path):
    """Workers on the tiny model drawn with another seed (same architecture, shapes,
    vocabulary, context and tokenizer: only the weights differ) are refused by a router on
    the first model (it sends them nothing); the first model's prefill worker refuses to
    send pages to the other's decode worker (its decode pool refused that model), and a
    decode worker refuses the other model's prefill worker at HELLO: no page crosses,
    every page is free."""
    c, g = pb.cluster_pb2, pb.generation_pb2
    other = make_tiny(bin_dir, tmp_path / "seed2", "--seed", 2)
    common = [f"--model={other}", "--port=0", "--threads=1", "--kv-cache-mib=64",
              "--grace-ms=3000", f"--cluster-secret={SECRET}"]
    pre_b = Proc(bin_dir / "chunkserve-prefill", common, "prefill-seed2")
    dec_b = Proc(bin_dir / "chunkserve-decode", common, "decode-seed2")
    router = None
    try:
        own = cl.status(cl.decode[0]).model
        sb = cl.status(dec_b).model
        assert (sb.architecture, sb.vocab_size, sb.context_length) == \
            (own.architecture, own.vocab_size, own.context_length)
        assert sb.tokenizer_fingerprint == own.tokenizer_fingerprint != 0
        assert sb.fingerprint != own.fingerprint and 0 not in (sb.fingerprint, own.fingerprint)
        assert cl.status(pre_b).model.fingerprint == sb.fingerprint

        # A router on the first model in front of both models' workers: only its own are usable.
        router = Proc(bin_dir / "chunkserve-router", [
            f"--model={cl.model_path}", "--port=0", "--status-interval-ms=100", "--grace-ms=3000",
            f"--cluster-secret={SECRET}", "--local-prefill-threshold=1",
            f"--prefill-workers={cl.prefill[0].addr},{pre_b.addr}",
            f"--decode-workers={cl.decode[0].addr},{dec_b.addr}"], "router-mixed")
        wait_for(lambda: "serves another model" in router.stderr() and
                 router.stderr().count("serves another model") >= 2, 20,
                 "the router to refuse both seed-2 workers")
        m = router.metrics()
        assert metric(m, "chunkserve:workers_usable", 'role="prefill"') == 1
        assert metric(m, "chunkserve:workers_usable", 'role="decode"') == 1
        assert f"{sb.fingerprint:016x}" in router.stderr()
        stub = pb.generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router.addr))
        for i in range(4):
            ids, _, finish, _ = generate(stub, g, ids=[(5 * i + j) % 300 + 1 for j in range(40)],
                                         max_tokens=6, ignore_eos=True, timeout=60)
            assert len(ids) == 6 and finish == g.FINISH_REASON_LENGTH
        for p in (pre_b, dec_b):
            assert p.metric("chunkserve:prompt_tokens_total") == 0, p.name

        # The first model's prefill worker knows its decode pool: it refuses the other
        # model's decode worker before connecting (its pool saw the fingerprint).
        before = cl.prefill[0].metric("chunkserve:kv_endpoint_refused_total")
        with pytest.raises(grpc.RpcError) as e:
            cl.worker_stub(cl.prefill[0]).Prefill(c.PrefillRequest(
                request_id="mix-0", transfer_id=777, token_ids=[5] * 40,
                num_prompt_tokens=40, kv_endpoint=cl.status(dec_b).kv_endpoint,
                decode_worker_id="d", sampling=g.SamplingParams(max_tokens=1)),
                timeout=30, metadata=rpc_token(SECRET))
        assert e.value.code() == grpc.StatusCode.ABORTED
        assert cl.prefill[0].metric("chunkserve:kv_endpoint_refused_total") == before + 1
        assert "model mismatch" not in dec_b.stderr()  # nobody knocked
        # At HELLO: a prefill worker with no decode list (pre_b) pointed at the first
        # model's decode worker is refused there.
        before = cl.decode[0].metric("chunkserve:kv_protocol_errors_total")
        with pytest.raises(grpc.RpcError) as e:
            cl.worker_stub(pre_b).Prefill(c.PrefillRequest(
                request_id="mix-1", transfer_id=778, token_ids=[5] * 40,
                num_prompt_tokens=40, kv_endpoint=cl.status(cl.decode[0]).kv_endpoint,
                decode_worker_id="d", sampling=g.SamplingParams(max_tokens=1)),
                timeout=30, metadata=rpc_token(SECRET))
        assert e.value.code() != grpc.StatusCode.OK
        wait_for(lambda: "model mismatch" in cl.decode[0].stderr(), 10,
                 "the decode worker to log the refusal")
        assert cl.decode[0].metric("chunkserve:kv_protocol_errors_total") > before
        for p in (pre_b, dec_b):
            s = cl.status(p)
            assert s.kv_pages_free == s.kv_pages_total and not s.num_running, p.name
    finally:
        if router:
            router.stop()
        for p in (pre_b, dec_b):
            p.stop()
    pages_free(cl)
    canary(cl, pb)
    pages_free(cl)


def h2_half_sent(addr: str, body: int, t_end: float) -> tuple:
    """One HTTP/2 connection that starts a Generate call announcing a `body`-byte message
    and sends all of it but the last byte, as fast as the server's flow-control windows
    allow, until it stops granting more (or t_end). Returns (socket, bytes sent): the
    caller keeps the socket open, holding whatever the server buffered (a server under
    memory pressure answers GOAWAY ENHANCE_YOUR_CALM "Buffers full" and drops it)."""
    import h2.config
    import h2.connection
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", addr),
                            (":path", "/chunkserve.v1.Generation/Generate"),
                            ("content-type", "application/grpc"), ("te", "trailers")])
    data = struct.pack(">BI", 0, body) + b"\x01" * (body - 1)
    sent = 0
    sock.settimeout(0.3)
    try:
        while sent < len(data) and time.monotonic() < t_end:
            n = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size,
                    len(data) - sent)
            if n > 0:
                conn.send_data(sid, data[sent:sent + n])
                sent += n
            sock.sendall(conn.data_to_send())
            if n <= 0:  # wait for a window update
                try:
                    chunk = sock.recv(65536)
                except socket.timeout:
                    break  # the server grants no more: it is holding back
                if not chunk:
                    break
                conn.receive_data(chunk)
                sock.sendall(conn.data_to_send())
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server dropped the connection (GOAWAY "Buffers full", then close)
    return sock, sent


def test_watch_flood_and_half_sent_bodies_leave_the_router_bounded(cl, pb):
    """300 grpc.health.v1 Health/Watch streams: the first 256 (--grpc-max-health-watches)
    stream SERVING, the rest are refused with RESOURCE_EXHAUSTED; then 100 HTTP/2
    connections each announce a 4 MiB Generate request and send all of it but its last
    byte (400 MiB announced) and hold it. The router's RSS grows by less than its gRPC
    memory quota (--grpc-memory-mib=64) plus 96 MiB, a canary still succeeds while all
    of it is held, and everything is released when the attackers leave."""
    h = pb.health_pb2
    ch = grpc.insecure_channel(cl.router.addr)
    watch = ch.unary_stream("/grpc.health.v1.Health/Watch",
                            request_serializer=h.HealthCheckRequest.SerializeToString,
                            response_deserializer=h.HealthCheckResponse.FromString)
    base = rss_kib(cl.router.proc.pid)
    streams, ok, refused = [], 0, 0
    for _ in range(300):
        it = watch(h.HealthCheckRequest(service=""), timeout=120)
        try:
            assert next(it).status == h.HealthCheckResponse.SERVING
            ok += 1
            streams.append(it)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert "Health/Watch" in e.details()
            refused += 1
    assert (ok, refused) == (256, 44)
    canary(cl, pb, n=1)
    for it in streams:
        it.cancel()
    # the slots come back
    def one_more():
        it = watch(h.HealthCheckRequest(service=""), timeout=10)
        try:
            return next(it).status == h.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
        finally:
            it.cancel()
    wait_for(one_more, 10, "a Health/Watch slot after the flood ended")
    ch.close()

    t_end = time.monotonic() + 60
    held = [h2_half_sent(cl.router.addr, 4 << 20, t_end) for _ in range(100)]
    accepted = sum(n for _, n in held)
    grown_mib = (rss_kib(cl.router.proc.pid) - base) / 1024
    canary(cl, pb, n=1)
    print(f"half-sent bodies: {accepted / 2**20:.0f} MiB written of {100 * 4} MiB announced, "
          f"router RSS +{grown_mib:.0f} MiB (without the quota: about +410 MiB)")
    assert grown_mib < ROUTER_GRPC_MIB + 96, f"router RSS grew by {grown_mib:.0f} MiB"
    for sock, _ in held:
        sock.close()
    pages_free(cl)
    canary(cl, pb)
    pages_free(cl)


def test_cache_salt_keeps_tenants_apart(cl, pb):
    """The same prompt under two cache salts: the second salt sees 0 cached prompt tokens
    (so it learns nothing about the first tenant's prompts), its own repeat sees the full
    pages cached, and the shared (empty) namespace is a third one. A salt over 256 bytes is
    refused. Through the router to a prefill worker (every prompt crosses the KV link)."""
    g = pb.generation_pb2
    prompt = [(11 * j) % 300 + 1 for j in range(64)]  # 3 full 16-token pages cacheable

    def cached(salt):
        msgs = list(cl.stub.Generate(g.GenerateRequest(
            token_ids=g.TokenIds(ids=prompt), cache_salt=salt,
            sampling=g.SamplingParams(max_tokens=2, ignore_eos=True)), timeout=60))
        u = [m.usage for m in msgs if m.HasField("usage")][-1]
        assert u.prompt_tokens == 64
        return u.cached_prompt_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") == 48
    assert cached("tenant-b") == 48
    assert cached("") == 0
    assert cached("") == 48
    assert cached("tenant-c") == 0
    with pytest.raises(grpc.RpcError) as e:
        cached("x" * 257)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in e.value.details()
    pages_free(cl)
    canary(cl, pb)
    pages_free(cl)


def test_foreign_kv_endpoint_is_no_oracle(cl, pb):
    """Prefill pointed at a kv_endpoint that is not a decode worker's: the prefill worker
    knows its decode pool (--decode-dns, as the chart deploys it) and never connects
    anywhere else, with or without the token.  A closed port, a listener that accepts and
    stays silent, and one that would answer garbage all give the same ABORTED and the same
    words as a failed transfer (no "refused", "timed out" or address), the cause only in
    the prefill worker's log and its kv_endpoint_refused_total; nothing is reserved, and
    the real decode worker's endpoint still works."""
    c, g = pb.cluster_pb2, pb.generation_pb2
    stub = cl.worker_stub(cl.prefill[0])
    lis = socket.socket()
    lis.bind(("127.0.0.1", 0))
    lis.listen(16)
    lis.settimeout(0.2)
    ep = f"127.0.0.1:{lis.getsockname()[1]}"

    def prefill(endpoint, md, n):
        return stub.Prefill(c.PrefillRequest(
            request_id=f"foreign-{n}", transfer_id=9000 + n, token_ids=[5] * 40,
            num_prompt_tokens=40, kv_endpoint=endpoint, decode_worker_id="d",
            sampling=g.SamplingParams(max_tokens=1)), timeout=20, metadata=md)

    with pytest.raises(grpc.RpcError) as e:
        prefill(ep, [], 0)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    stop = threading.Event()
    came = []

    def garbage_server():
        while not stop.is_set():
            try:
                s, _ = lis.accept()
            except socket.timeout:
                continue
            came.append(1)
            s.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + os.urandom(200))
            threading.Timer(5, s.close).start()

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_ep = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # nothing listens there now
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # would accept (in the backlog) and never answer
    silent_ep = f"127.0.0.1:{silent.getsockname()[1]}"
    t = threading.Thread(target=garbage_server, daemon=True)
    t.start()
    before = cl.prefill[0].metric("chunkserve:kv_endpoint_refused_total")
    answers = []
    try:
        for n, endpoint in enumerate((closed_ep, silent_ep, ep), start=1):
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                prefill(endpoint, rpc_token(SECRET), n)
            answers.append((e.value.code(), e.value.details()))
            assert time.monotonic() - t0 < 15  # refused after one status staleness, no hang
        silent.settimeout(0)
        with pytest.raises(BlockingIOError):
            silent.accept()  # nothing waits in its backlog
    finally:
        stop.set()
        t.join(timeout=5)
        silent.close()
        lis.close()
    assert not came, "the prefill worker connected to a foreign endpoint"
    assert len(set(answers)) == 1, answers
    code, details = answers[0]
    assert code == grpc.StatusCode.ABORTED  # the KV pair failed, not the worker
    assert "KV transfer" in details
    for leak in ("refused", "timed out", "127.0.0.1", "reset", "HTTP", "known"):
        assert leak not in details, details
    assert cl.prefill[0].metric("chunkserve:kv_endpoint_refused_total") - before == 3
    assert "is not the KV endpoint of a decode worker" in cl.prefill[0].stderr()
    pages_free(cl)
    canary(cl, pb)
    pages_free(cl)
