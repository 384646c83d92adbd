#!/usr/bin/env python3
"""bench_rpc.py: what the RPC layer alone carries on loopback (issue 5).

Starts chunkserve-echo-server (tests/rpc/echo_server.c: the C layer serving chunkserve.v1.Echo)
and measures, with generation replaced by nothing but the stream itself:

  * messages/s one server-streaming call carries (Echo/Stream, as fast as the stream takes
    them), each message the size of a GenerateResponse carrying one token and a short text
    delta (its serialized bytes are the echoed payload);
  * unary calls/s, one call in flight and several.

Both with a Python grpcio client and, when built, with the layer's own C client
(chunkserve-bench-rpc, tests/rpc/bench_rpc_client.c), so the client is not the bottleneck.
Prints a Markdown table.  Nothing here asserts a speed.

  python3 bench/bench_rpc.py [--bin-dir build/bin] [--messages 20000] [--unary 3000] [--repeat 3]
"""
from __future__ import annotations

import argparse
import importlib
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[1]


def stubs(out: Path):
    include = Path(protoc.__file__).parent / "_proto"
    for p in ("chunkserve/v1/echo.proto", "chunkserve/v1/generation.proto"):
        rc = protoc.main(["grpc_tools.protoc", f"-I{REPO_ROOT / 'proto'}", f"-I{include}",
                          f"--python_out={out}", f"--grpc_python_out={out}", p])
        if rc != 0:
            sys.exit(f"grpc_tools.protoc failed on {p}")
    sys.path.insert(0, str(out))
    return (importlib.import_module("chunkserve.v1.echo_pb2"),
            importlib.import_module("chunkserve.v1.generation_pb2"))


def token_message(gen_pb2) -> bytes:
    """A GenerateResponse as the server streams it mid-generation: one token, its text."""
    return gen_pb2.GenerateResponse(token_ids=[15043], text=" world").SerializeToString()


def py_stream(stub, echo_pb2, payload: bytes, n: int) -> float:
    t0 = time.perf_counter()
    got = 0
    for m in stub.Stream(echo_pb2.EchoRequest(payload=payload, count=n), timeout=300):
        got += 1
    dt = time.perf_counter() - t0
    assert got == n, (got, n)
    return n / dt


def py_unary(stub, echo_pb2, payload: bytes, n: int, in_flight: int) -> float:
    req = echo_pb2.EchoRequest(payload=payload)
    t0 = time.perf_counter()
    if in_flight == 1:
        for _ in range(n):
            stub.Unary(req, timeout=30)
    else:
        def worker(k):
            for _ in range(k):
                stub.Unary(req, timeout=30)
        with ThreadPoolExecutor(in_flight) as ex:
            list(ex.map(worker, [n // in_flight] * in_flight))
        n = (n // in_flight) * in_flight
    return n / (time.perf_counter() - t0)


def c_client(exe: Path, target: str, *args) -> float:
    out = subprocess.run([str(exe), target, *map(str, args)], check=True, capture_output=True,
                         text=True, timeout=300).stdout
    return json.loads(out)["per_s"]


def median_of(repeat: int, fn) -> float:
    return statistics.median(fn() for _ in range(repeat))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", default=str(REPO_ROOT / "build" / "bin"))
    ap.add_argument("--messages", type=int, default=20000, help="messages in the streaming call")
    ap.add_argument("--unary", type=int, default=3000, help="unary calls per measurement")
    ap.add_argument("--repeat", type=int, default=3, help="measurements per figure (median)")
    a = ap.parse_args()
    bin_dir = Path(a.bin_dir)

    tmp = Path(tempfile.mkdtemp(prefix="bench_rpc_"))
    echo_pb2, gen_pb2 = stubs(tmp)
    payload = token_message(gen_pb2)
    wire = len(echo_pb2.EchoResponse(payload=payload, seq=a.messages - 1).SerializeToString())

    srv = subprocess.Popen([str(bin_dir / "chunkserve-echo-server")], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL)
    try:
        line = srv.stdout.readline().decode()
        assert line.startswith("port "), line
        target = f"127.0.0.1:{int(line.split()[1])}"
        ch = grpc.insecure_channel(target)
        stub = importlib.import_module("chunkserve.v1.echo_pb2_grpc").EchoStub(ch)
        stub.Unary(echo_pb2.EchoRequest(payload=payload), timeout=10)  # connect

        rows = []
        rows.append(("grpcio (Python)", "stream: messages/s of one call",
                     median_of(a.repeat, lambda: py_stream(stub, echo_pb2, payload, a.messages))))
        for k in (1, 8):
            rows.append(("grpcio (Python)", f"unary calls/s, {k} in flight",
                         median_of(a.repeat, lambda: py_unary(stub, echo_pb2, payload, a.unary, k))))
        cexe = bin_dir / "chunkserve-bench-rpc"
        if cexe.is_file():
            hexp = payload.hex()
            rows.append(("C layer client", "stream: messages/s of one call",
                         median_of(a.repeat, lambda: c_client(cexe, target, "stream", hexp,
                                                              a.messages * 5))))
            for k in (1, 8):
                rows.append(("C layer client", f"unary calls/s, {k} in flight",
                             median_of(a.repeat, lambda: c_client(cexe, target, "unary", hexp,
                                                                  a.unary * 2, k))))
        ch.close()
    finally:
        srv.send_signal(signal.SIGTERM)
        try:
            srv.wait(timeout=10)
        except subprocess.TimeoutExpired:
            srv.kill()

    print(f"payload: a serialized GenerateResponse with 1 token id and a 6-byte text delta "
          f"({len(payload)} bytes; {wire} bytes per EchoResponse); median of {a.repeat}\n")
    print("| client | measure | per second |\n| --- | --- | --- |")
    for client, what, v in rows:
        print(f"| {client} | {what} | {v:,.0f} |")


if __name__ == "__main__":
    main()
