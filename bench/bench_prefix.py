#!/usr/bin/env python3
"""Prefix-aware vs load-only placement (issue 20's measure), side by side in one run.

The same cluster twice on the real model (router, one prefill worker, two decode
workers, one thread each; --prefix-routing true, then false), the same two workloads:
  rag    --docs documents of --doc-tokens random token ids; --rag requests, each one
         document (Zipf-ish: document k with weight 1/(k+1)) plus a --question-tokens
         question of its own, --clients at a time
  chat   --convs conversations of --turns turns: each turn is the conversation so far
         (every earlier question and answer) plus a new question, --clients
         conversations at a time
Each request: greedy, --max-tokens answer tokens, ignore_eos.
Reported per mode and workload: TTFT p50/p99 (client side), prompt tokens computed
(prompt tokens - the workers' cached prompt tokens), the router's predicted cached
tokens, requests/s, and where prefills ran.
Usage: bench/bench_prefix.py [--rag 96] [--convs 8]
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "py"))
sys.path.insert(0, str(ROOT / "bench"))

import grpc  # noqa: E402

from bench_router_lag import pct, protos  # noqa: E402
from cluster_harness import Proc, metric  # noqa: E402


def ask(g, stub, ids, n):
    t0 = time.monotonic()
    ttft, out, cached = None, [], 0
    for m in stub.Generate(g.GenerateRequest(token_ids=g.TokenIds(ids=ids),
                                             sampling=g.SamplingParams(max_tokens=n, ignore_eos=True)),
                           timeout=600):
        if m.token_ids and ttft is None:
            ttft = time.monotonic() - t0
        out += list(m.token_ids)
        if m.HasField("usage"):
            cached = m.usage.cached_prompt_tokens
    return ttft, out, cached


def run_mode(a, g, gg, prefix_on, workloads):
    common = [f"--model={a.model}", "--port=0", "--threads=1", "--kv-cache-mib=512"]
    bin_dir = Path(a.bin)
    dec = [Proc(bin_dir / "chunkserve-decode", common, f"decode-{i}") for i in range(2)]
    pre = Proc(bin_dir / "chunkserve-prefill", common, "prefill")
    router = Proc(bin_dir / "chunkserve-router", [
        f"--model={a.model}", "--port=0", "--status-interval-ms=200",
        f"--prefix-routing={'true' if prefix_on else 'false'}", f"--prefill-workers={pre.addr}",
        f"--decode-workers={dec[0].addr},{dec[1].addr}"], "router")
    out = {}
    try:
        t_end = time.monotonic() + 60
        while metric(router.metrics(), "chunkserve:workers_usable", 'role="decode"') < 2:
            assert time.monotonic() < t_end, "decode workers never usable"
            time.sleep(0.2)
        stub = gg.GenerationStub(grpc.insecure_channel(router.addr))
        for name, jobs in workloads.items():
            m0 = router.metrics()
            ttfts, cached_sum, prompt_sum, lock = [], [0], [0], threading.Lock()
            t0 = time.monotonic()

            def worker(chains):
                for chain in chains:  # a chain: requests that depend on the one before
                    hist = []
                    for step in chain:
                        ids = step(hist)
                        ttft, toks, cached = ask(g, stub, ids, a.max_tokens)
                        hist = ids + toks
                        with lock:
                            ttfts.append(ttft)
                            cached_sum[0] += cached
                            prompt_sum[0] += len(ids)
            parts = [jobs[i::a.clients] for i in range(a.clients)]
            ts = [threading.Thread(target=worker, args=(p,)) for p in parts]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            took = time.monotonic() - t0
            m1 = router.metrics()

            def d(name, labels=""):
                return metric(m1, name, labels) - metric(m0, name, labels)
            out[name] = dict(n=len(ttfts), p50=pct(ttfts, 0.5), p99=pct(ttfts, 0.99),
                             computed=prompt_sum[0] - cached_sum[0], prompt=prompt_sum[0],
                             predicted=d("chunkserve:prefix_predicted_tokens_total"),
                             rps=len(ttfts) / took,
                             local=d("chunkserve:prefills_total", 'path="local"'),
                             remote=d("chunkserve:prefills_total", 'path="remote"'))
    finally:
        for p in [router, pre, *dec]:
            p.stop()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "build" / "bin"))
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--rag", type=int, default=96)
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    g, gg = protos(Path("/tmp/bench-prefix-stubs"))
    docs = [[rng.randrange(1, 49000) for _ in range(a.doc_tokens)] for _ in range(a.docs)]
    weights = [1 / (k + 1) for k in range(a.docs)]
    rag = []
    for _ in range(a.rag):
        doc = rng.choices(range(a.docs), weights)[0]
        q = [rng.randrange(1, 49000) for _ in range(a.question_tokens)]
        rag.append([lambda hist, doc=doc, q=q: docs[doc] + q])
    chat = []
    for _ in range(a.convs):
        qs = [[rng.randrange(1, 49000) for _ in range(a.question_tokens)] for _ in range(a.turns)]
        chat.append([lambda hist, q=q: hist + q for q in qs])
    workloads = {"rag": rag, "chat": chat}
    res = {mode: run_mode(a, g, gg, mode == "prefix-aware", workloads)
           for mode in ("prefix-aware", "load-only")}
    print(f"{'workload':6} {'mode':13} {'n':>4} {'TTFT p50 ms':>11} {'p99 ms':>8} "
          f"{'computed/prompt tokens':>24} {'predicted':>9} {'req/s':>6} {'local/remote':>12}")
    for w in workloads:
        for mode in res:
            r = res[mode][w]
            print(f"{w:6} {mode:13} {r['n']:4d} {1e3 * r['p50']:11.0f} {1e3 * r['p99']:8.0f} "
                  f"{r['computed']:>11,}/{r['prompt']:<12,} {r['predicted']:9.0f} {r['rps']:6.2f} "
                  f"{r['local']:5.0f}/{r['remote']:<6.0f}")


if __name__ == "__main__":
    main()
