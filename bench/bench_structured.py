#!/usr/bin/env python3
"""What structured outputs cost a serving batch: the same chat requests with and without a
JSON Schema (response_format json_schema), CONCURRENCY at a time, against one
`chunkserve serve`, rounds alternating so machine noise falls on both alike.

Per round and mode: the batch's decode throughput (completion tokens from each stream's
usage / the round's wall time) and the p50 / p99 / max of the gaps between streamed chunks. Free-text
requests use ignore_eos and a fixed max_tokens; structured ones end where their JSON ends,
so throughput is compared per generated token, not per request. The first structured round
meets a cold mask cache (every state walks the vocabulary once); later rounds find it
warm, as a server does once a schema has been seen. Nothing here asserts a speed.

  python3 bench/bench_structured.py [--bin build/bin/chunkserve] [--model M]
                                    [--concurrency 32] [--rounds 3] [--tokens 96]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "email", "tags", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "email": {"type": "string", "format": "email"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                  "maxItems": 4},
                         "city": {"type": "string", "maxLength": 30}}}


def start(binary, model, threads):
    p = subprocess.Popen([binary, "serve", "--model", model, "--port", "0", "--openai-port", "0",
                          "--threads", str(threads), "--kv-cache-mib", "512"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    lines = [p.stdout.readline().decode().strip() for _ in range(3)]
    return p, lines[2].split()[-1]


def one(client, model, seed, structured, tokens, gaps, usage):
    kw = dict(model=model, temperature=0.7, seed=seed, max_tokens=tokens, stream=True,
              stream_options={"include_usage": True},
              messages=[{"role": "user", "content": f"Invent person number {seed} as JSON: "
                                                    "name, age, email, tags, city."}])
    if structured:
        kw["response_format"] = {"type": "json_schema",
                                 "json_schema": {"name": "person", "schema": SCHEMA}}
    else:
        kw["extra_body"] = {"ignore_eos": True}
    last, text, mine = None, "", []
    for c in client.chat.completions.create(**kw):
        if c.usage:
            usage.append(c.usage.completion_tokens)
        if c.choices and c.choices[0].delta.content:
            now = time.perf_counter()
            if last is not None:
                mine.append(now - last)
            last = now
            text += c.choices[0].delta.content
    if structured and c.choices and c.choices[0].finish_reason == "stop":
        json.loads(text)  # an answer that ended by end-of-generation parses
    gaps.extend(mine)


def round_of(client, model, conc, structured, tokens, round_no):
    gaps, usage = [], []
    threads = [threading.Thread(target=one, args=(client, model, round_no * 1000 + i, structured,
                                                  tokens, gaps, usage)) for i in range(conc)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, usage, gaps


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * (len(v) - 1)))] if v else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/bin/chunkserve")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    p, http = start(a.bin, a.model, a.threads)
    try:
        client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="x", max_retries=0,
                               timeout=600)
        model = client.models.list().data[0].id
        rows = []
        for r in range(a.rounds):
            for structured in (False, True):
                wall, usage, gaps = round_of(client, model, a.concurrency, structured, a.tokens, r)
                rows.append((r, "json_schema" if structured else "free text", wall, sum(usage),
                             gaps))
        print(f"model {Path(a.model).name}, concurrency {a.concurrency}, max_tokens {a.tokens}, "
              f"{a.threads} threads")
        print("| round | mode | wall s | completion tokens | tok/s | ITL p50 / p99 / max ms |")
        print("|---|---|---|---|---|---|")
        for r, mode, wall, toks, gaps in rows:
            print(f"| {r} | {mode} | {wall:.2f} | {toks} | {toks / wall:.1f} | "
                  f"{pct(gaps, 0.5) * 1e3:.1f} / {pct(gaps, 0.99) * 1e3:.1f} / "
                  f"{max(gaps) * 1e3 if gaps else float('nan'):.1f} |")
    finally:
        p.terminate()
        p.wait(30)


if __name__ == "__main__":
    sys.exit(main())
