#!/usr/bin/env python3
"""make demo's client: talks to a running chunkserve cluster through the public
gRPC API (stubs generated from proto/ with grpcio-tools), like any user would.

Sends one long-document question (several thousand tokens: remote prefill on the
prefill worker, KV pages streamed to the decode worker) and several concurrent
chats (short: prefilled on the decode worker), prints the streamed answers and a
summary: TTFT and p50/p99 inter-token latency per stream, and the KV pages the
workers transferred (from their /metrics). Then one chat streamed through the
OpenAI-compatible HTTP API with the official `openai` client. The chats sample
(temperature 0.7, top_p 0.9, repetition penalty 1.1, a fixed seed): greedy
decoding makes this small model loop."""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]


def stubs():
    out = tempfile.mkdtemp(prefix="chunkserve-demo-")
    inc = Path(protoc.__file__).parent / "_proto"
    for p in ("chunkserve/v1/generation.proto", "chunkserve/v1/cluster.proto"):
        assert protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{inc}", f"--python_out={out}",
                            f"--grpc_python_out={out}", p]) == 0
    sys.path.insert(0, out)
    return (importlib.import_module("chunkserve.v1.generation_pb2"),
            importlib.import_module("chunkserve.v1.generation_pb2_grpc"))


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def metrics(url):
    out = {}
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    k, v = line.rsplit(" ", 1)
                    out[k] = float(v)
    except OSError:
        pass
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--http", nargs="*", default=[], help="workers' HTTP addresses (for KV metrics)")
    ap.add_argument("--openai", help="the router's OpenAI-compatible API base URL (.../v1)")
    a = ap.parse_args()
    g, gg = stubs()
    stub = gg.GenerationStub(grpc.insecure_channel(a.addr))
    doc = (ROOT / "docs" / "architecture.md").read_text()[:14000]
    jobs = [("document", g.Chat(messages=[g.ChatMessage(role="user", content=doc + "\n\nIn two sentences: what "
                                                         "does the document above describe?")]), 80)]
    for q in ("What is the capital of France, and what is it famous for?",
              "Write a haiku about a cache.", "Give me three tips for writing clear code.",
              "Why is the sky blue? Answer briefly."):
        jobs.append((q, g.Chat(messages=[g.ChatMessage(role="user", content=q)]), 64))
    lock = threading.Lock()
    before = [metrics(h) for h in a.http]

    def run(job):
        name, chat, n = job
        t0 = time.monotonic()
        stamps, text, usage = [], [], None
        sampling = g.SamplingParams(max_tokens=n, temperature=0.7, top_p=0.9, repetition_penalty=1.1,
                                    seed=42)
        for m in stub.Generate(g.GenerateRequest(chat=chat, sampling=sampling), timeout=600):
            now = time.monotonic()
            stamps += [now] * len(m.token_ids)
            text.append(m.text)
            if m.usage.prompt_tokens:
                usage = m.usage
        itl = [b - c for b, c in zip(stamps[1:], stamps[:-1])]
        with lock:
            print(f"\n--- {name[:60]}{'...' if len(name) > 60 else ''} ({usage.prompt_tokens} prompt tokens)")
            print("".join(text).strip())
        return name, usage.prompt_tokens, len(stamps), stamps[0] - t0 if stamps else float("nan"), itl

    print(f"chunkserve demo: {len(jobs)} concurrent streams to the cluster at {a.addr}")
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        rows = list(ex.map(run, jobs))
    print("\nstream                                      prompt  tokens   TTFT s  ITL p50 ms  ITL p99 ms")
    for name, n_prompt, n, ttft, itl in rows:
        print(f"{name[:42]:42} {n_prompt:7d} {n:7d} {ttft:8.3f} {pct(itl, .5) * 1e3:11.1f} {pct(itl, .99) * 1e3:11.1f}")
    after = [metrics(h) for h in a.http]
    pages = sum(m.get("chunkserve:kv_transfer_bytes_total", 0) - b.get("chunkserve:kv_transfer_bytes_total", 0)
                for m, b in zip(after, before))
    xfers = sum(m.get("chunkserve:kv_transfers_completed_total", 0) - b.get("chunkserve:kv_transfers_completed_total", 0)
                for m, b in zip(after, before))
    print(f"\nKV transferred prefill -> decode: {xfers / 2:.0f} transfers, {pages / 2 / 2**20:.1f} MiB "
          f"(counted on both ends)")
    if a.openai:
        openai_stream(a.openai)


def openai_stream(base_url):
    """One chat through the OpenAI-compatible API, streamed, with the official client."""
    try:
        import openai
    except ImportError:
        print("\n(the `openai` package is not installed: pip install openai, to see the HTTP API)")
        return
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    q = "Name three things a good README should have."
    print(f"\n--- OpenAI API ({base_url}): {q}")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": q}], max_tokens=80, temperature=0.7,
        top_p=0.9, seed=42, stream=True, stream_options={"include_usage": True},
        extra_body={"repetition_penalty": 1.1})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n({chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} "
                  "completion tokens)")


if __name__ == "__main__":
    main()
