#!/usr/bin/env python3
"""How much of a KV transfer hides under prefill compute (issue 6's measure).

Starts one chunkserve-decode and one chunkserve-prefill worker (no router: the
bench drives Worker/Decode + Worker/Prefill itself, as the router does) and
sends one long prompt (default 8000 tokens) prefilled in chunks of --chunk
tokens. The prefill worker streams each chunk's pages while the next chunk
computes. Reported, from one run:
  prefill+transfer time   Prefill call to trailer acknowledged
  exposed tail            last chunk computed -> trailer acknowledged (the only
                          transfer time left on the critical path)
  whole-transfer cost     the same bytes sent with no compute to hide behind:
                          a second request whose prompt is fully prefix-cached on
                          the prefill worker, so its pages are all sent at once
Usage: bench/bench_kv_overlap.py --bin build/bin --model models/...gguf"""
from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_tools import protoc
import importlib

ROOT = Path(__file__).resolve().parents[1]


def stubs():
    out = tempfile.mkdtemp(prefix="chunkserve-bench-")
    inc = Path(protoc.__file__).parent / "_proto"
    for p in ("chunkserve/v1/generation.proto", "chunkserve/v1/cluster.proto"):
        assert protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{inc}", f"--python_out={out}",
                            f"--grpc_python_out={out}", p]) == 0
    sys.path.insert(0, out)
    return (importlib.import_module("chunkserve.v1.generation_pb2"),
            importlib.import_module("chunkserve.v1.cluster_pb2"),
            importlib.import_module("chunkserve.v1.cluster_pb2_grpc"))


def start(exe, args):
    p = subprocess.Popen([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    port = int(re.search(r":(\d+)$", p.stdout.readline().strip()).group(1))
    http = "http://" + p.stdout.readline().split()[-1]
    return p, port, http


def metrics(url):
    out = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/bin")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    g, c, cg = stubs()
    common = [f"--model={a.model}", "--port=0", "--kv-cache-mib=2048", f"--threads={a.threads}"]
    dec, dport, dhttp = start(f"{a.bin}/chunkserve-decode", common)
    pre, pport, phttp = start(f"{a.bin}/chunkserve-prefill", common + [f"--max-batched-tokens={a.chunk}"])
    try:
        dw = cg.WorkerStub(grpc.insecure_channel(f"127.0.0.1:{dport}"))
        pw = cg.WorkerStub(grpc.insecure_channel(f"127.0.0.1:{pport}"))
        st = dw.GetStatus(c.WorkerStatusRequest(), timeout=30)
        random.seed(1)
        toks = [random.randrange(100, 40000) for _ in range(a.tokens)]
        samp = g.SamplingParams(max_tokens=1)

        def one(tid):
            stream = dw.Decode(c.DecodeRequest(request_id=f"b{tid}", transfer_id=tid, token_ids=toks,
                                               num_prompt_tokens=len(toks), sampling=samp,
                                               lease_ms=600000), timeout=600)
            adm = next(stream).admitted
            t0 = time.monotonic()
            r = pw.Prefill(c.PrefillRequest(request_id=f"b{tid}", transfer_id=tid, token_ids=toks,
                                            num_prompt_tokens=len(toks), sampling=samp,
                                            kv_endpoint=adm.kv_endpoint, decode_worker_id=st.worker_id),
                           timeout=600)
            t1 = time.monotonic()
            for _ in stream:
                pass
            return t1 - t0, r

        m0 = metrics(phttp)
        total, r = one(1)
        m1 = metrics(phttp)
        tail = m1["chunkserve:kv_transfer_tail_seconds_sum"] - m0.get("chunkserve:kv_transfer_tail_seconds_sum", 0)
        # the same prompt again: every page is in the prefill worker's prefix cache
        # but the last, so the whole KV goes out at once with (almost) no compute
        total2, r2 = one(2)
        m2 = metrics(phttp)
        tail2 = m2["chunkserve:kv_transfer_tail_seconds_sum"] - m1["chunkserve:kv_transfer_tail_seconds_sum"]
        mb = r.kv_bytes / 2**20
        print(f"prompt {a.tokens} tokens in chunks of {a.chunk}: {r.num_pages} pages, {mb:.1f} MiB of KV")
        print(f"prefill + transfer (Prefill call to trailer acknowledged): {total:.3f} s")
        print(f"exposed tail (last chunk computed -> trailer acknowledged): {tail * 1e3:.1f} ms "
              f"= {tail / total * 100:.2f}% of the call")
        print(f"the same {mb:.1f} MiB sent with nothing to hide behind ({r2.num_cached_tokens} tokens cached): "
              f"{total2 * 1e3:.1f} ms ({mb / total2 / 1024:.2f} GiB/s; {tail2 * 1e3:.1f} ms of it from the pages "
              f"queued to the trailer acknowledged: {mb / tail2 / 1024:.2f} GiB/s)")
        print(f"hidden under compute: {max(0.0, 1 - tail / total2) * 100:.1f}% of the transfer "
              f"(tail / unhidden transfer = {tail / total2:.3f})")
    finally:
        for p in (pre, dec):
            p.terminate()
            p.wait(30)


if __name__ == "__main__":
    main()
