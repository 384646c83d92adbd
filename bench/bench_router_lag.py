#!/usr/bin/env python3
"""The router's loop during a burst of long prompts (issue 18: tokenization off
the loop thread).

One decode worker and the router on the real model. A few streams generate
short answers back to back (the "victims": their inter-token gaps are what a
stalled router loop shows first) while --clients threads send --burst
Generate calls, each a --kib KiB text that tokenizes past the model's context,
so each is refused INVALID_ARGUMENT after a full tokenization and no worker
does any work for it: the burst costs the router tokenization only.

Reported per router binary (--router, repeatable: e.g. the build before and
after a change, side by side in one run), --rounds times each, interleaved:
  lag max     chunkserve:router_loop_lag_max_seconds after the burst (how late
              its status timer fired at worst; over 1 s counts as a stall)
  stalls      chunkserve:router_loop_stalls_total
  victim ITL  p50/p99/max of the victims' gaps between messages during the burst
  burst s     wall time of the whole burst
Usage:
  bench/bench_router_lag.py --bin build/bin --router build/bin/chunkserve-router \\
      --router /tmp/old/build/bin/chunkserve-router
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "py"))

import grpc  # noqa: E402

from cluster_harness import Proc, metric  # noqa: E402


def protos(tmp: Path):
    from grpc_tools import protoc
    tmp.mkdir(parents=True, exist_ok=True)
    files = ["chunkserve/v1/generation.proto", "chunkserve/v1/cluster.proto"]
    rc = protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp}",
                      f"--grpc_python_out={tmp}", *[str(ROOT / "proto" / f) for f in files]])
    assert rc == 0
    sys.path.insert(0, str(tmp))
    from chunkserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
    return generation_pb2, generation_pb2_grpc


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def one_round(router_exe, args, g, gg, dec, text):
    router = Proc(Path(router_exe), [f"--model={args.model}", "--port=0", "--status-interval-ms=100",
                                     f"--decode-workers={dec.addr}"], "router")
    try:
        ch = grpc.insecure_channel(router.addr, options=[("grpc.max_send_message_length", 1 << 26)])
        stub = gg.GenerationStub(ch)
        t_end = time.monotonic() + 30
        while metric(router.metrics(), "chunkserve:workers_usable", 'role="decode"') < 1:
            assert time.monotonic() < t_end, "the decode worker never became usable"
            time.sleep(0.1)
        stop = threading.Event()
        gaps, burst_on = [], threading.Event()

        def victim():
            while not stop.is_set():
                last = None
                for m in stub.Generate(g.GenerateRequest(
                        prompt="Once upon a time", sampling=g.SamplingParams(
                            max_tokens=24, ignore_eos=True)), timeout=120):
                    now = time.monotonic()
                    if last is not None and burst_on.is_set():
                        gaps.append(now - last)
                    last = now

        codes = {}

        def burster(n):
            for _ in range(n):
                try:
                    stub.Generate(g.GenerateRequest(prompt=text, sampling=g.SamplingParams(
                        max_tokens=1)), timeout=120).next()
                    codes["OK"] = codes.get("OK", 0) + 1
                except grpc.RpcError as e:
                    codes[e.code().name] = codes.get(e.code().name, 0) + 1

        vs = [threading.Thread(target=victim, daemon=True) for _ in range(args.victims)]
        for v in vs:
            v.start()
        time.sleep(2)  # the victims stream
        burst_on.set()
        t0 = time.monotonic()
        per = args.burst // args.clients
        bs = [threading.Thread(target=burster, args=(per,)) for _ in range(args.clients)]
        for b in bs:
            b.start()
        for b in bs:
            b.join()
        took = time.monotonic() - t0
        burst_on.clear()
        stop.set()
        for v in vs:
            v.join(120)
        m = router.metrics()
        ch.close()
        return dict(lag=metric(m, "chunkserve:router_loop_lag_max_seconds"),
                    stalls=metric(m, "chunkserve:router_loop_stalls_total"),
                    p50=pct(gaps, 0.5), p99=pct(gaps, 0.99), max=max(gaps, default=float("nan")),
                    burst_s=took, codes=codes)
    finally:
        router.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "build" / "bin"))
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--router", action="append", required=True)
    ap.add_argument("--burst", type=int, default=240)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--victims", type=int, default=2)
    ap.add_argument("--kib", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    g, gg = protos(Path("/tmp/bench_router_lag_pb"))
    corpus = (ROOT / "docs" / "architecture.md").read_text()
    text = (corpus * (1 + args.kib * 1024 // len(corpus)))[:args.kib * 1024]
    dec = Proc(Path(args.bin) / "chunkserve-decode", [f"--model={args.model}", "--port=0",
                                                      "--threads=1", "--kv-cache-mib=64"], "decode")
    rows = []
    try:
        for rnd in range(args.rounds):
            for exe in args.router:
                r = one_round(exe, args, g, gg, dec, text)
                rows.append((exe, rnd, r))
                print(f"{exe} round {rnd}: lag max {r['lag']:.3f} s, stalls {r['stalls']:.0f}, "
                      f"victim ITL p50 {r['p50'] * 1e3:.0f} ms p99 {r['p99'] * 1e3:.0f} ms "
                      f"max {r['max'] * 1e3:.0f} ms, burst {r['burst_s']:.1f} s, {r['codes']}",
                      flush=True)
    finally:
        dec.stop()
    for exe in args.router:
        mine = [r for e, _, r in rows if e == exe]
        print(f"{exe}: lag max median {statistics.median(r['lag'] for r in mine):.3f} s, "
              f"victim ITL max median {statistics.median(r['max'] for r in mine) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
