#!/usr/bin/env python3
"""Speculative decoding against plain decoding: the same requests against `chunkserve
serve` without and with `--speculative ngram` (or `--spec draft:PATH`, a draft model's
drafts, e.g. Qwen2.5-Coder-0.5B for the 1.5B): both servers up, each
batch sent to one then the other (the order alternating round by round), so slow machine
noise falls on both sides of a ratio alike.

Workloads (completions, greedy unless said):
  code   code editing: the prompt holds a function and the start of its edited copy, so the
         answer repeats most of the prompt (prompt lookup's best case)
  edit   a whole-file edit: a 42-line module, a rename, the answer the whole file again in a
         code block (stops at its closing fence; about 270 tokens, so run it with
         --tokens 400): the answer is nearly all copy, as a code editor's "apply" request is
  rag    a passage and a question whose answer quotes it
  chat   free text at temperature 0.7 (little to look up: speculation must not lose)
At each concurrency (1, 4, 16 by default) all streams start together; per round and mode:
decode throughput (completion tokens after each stream's first, over the time from the
first first token to the last token) and the gaps between
streamed chunks (p50 / p99 / max). `ratio` is the ratio of the medians; `rounds` the lowest
and highest ratio within one round (both modes back to back): on a shared machine that
spread, not the median, says whether a difference is real. The speculating server's
spec_decode counters give the
acceptance. Outputs are compared too (greedy and seeded output is byte-identical by
design). Nothing here asserts a speed.

  python3 bench/bench_spec.py [--bin build/bin/chunkserve] [--model M] [--rounds 3]
                              [--concurrency 1,4,16] [--tokens 128] [--drafts 4]
                              [--spec ngram|draft:PATH] [--workloads code,edit,rag,chat]
                              [--trace DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import threading
import time
import urllib.request

import openai

CODE = ("Rename the variable total to running_sum in this Python function. Keep everything "
        "else the same.\n\ndef summarize(values, scale):\n    total = 0\n    count = 0\n"
        "    for v in values:\n        if v is None:\n            continue\n"
        "        total = total + v * scale\n        count = count + 1\n    if count == 0:\n"
        "        return 0\n    mean = total / count\n    return mean, total, count\n\n"
        "Edited function:\ndef summarize(values, scale):\n    running_sum = 0\n")
RAG = ("Passage: The Amazon rainforest covers much of the Amazon basin of South America. "
       "The basin covers seven million square kilometres, of which five and a half million "
       "square kilometres are covered by the rainforest. The region includes territory "
       "belonging to nine nations. The majority of the forest is contained within Brazil, with "
       "60% of the rainforest, followed by Peru with 13%, and Colombia with 10%.\n\n"
       "Question: How much of the rainforest is in Brazil, Peru and Colombia?\nAnswer: "
       "The majority of the forest is contained within Brazil,")
EDIT_FILE = """import time


class LruCache:
    \"\"\"A least-recently-used cache with a time limit per entry.\"\"\"

    def __init__(self, capacity, ttl_seconds):
        self.capacity = capacity
        self.ttl_seconds = ttl_seconds
        self.entries = {}
        self.order = []

    def get_item(self, key):
        entry = self.entries.get(key)
        if entry is None:
            return None
        value, stored_at = entry
        if time.monotonic() - stored_at > self.ttl_seconds:
            self.remove(key)
            return None
        self.order.remove(key)
        self.order.append(key)
        return value

    def put(self, key, value):
        if key in self.entries:
            self.order.remove(key)
        elif len(self.entries) >= self.capacity:
            oldest = self.order.pop(0)
            del self.entries[oldest]
        self.entries[key] = (value, time.monotonic())
        self.order.append(key)

    def remove(self, key):
        if key in self.entries:
            del self.entries[key]
            self.order.remove(key)

    def warm(self, pairs):
        for key, value in pairs:
            self.put(key, value)
        return [self.get_item(key) for key, _ in pairs]
"""
EDIT = ("Rename the method get_item to lookup everywhere in this file. Reply with the whole "
        "updated file and nothing else.\n\n```python\n" + EDIT_FILE + "```\n\nUpdated file:\n"
        "```python\n")
CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
WORKLOADS = {"code": (CODE, 0.0), "edit": (EDIT, 0.0), "rag": (RAG, 0.0), "chat": (CHAT, 0.7)}
STOP = {"edit": ["```"]}  # the end of the code block ends the answer
IGNORE_EOS = {"chat"}  # a full-length answer: what speculation costs where it finds little


def start(binary, model, threads, spec, drafts, mode, trace):
    env = dict(os.environ)
    if trace:  # one step trace per server (serve's CHUNKSERVE_STEP_TRACE)
        os.makedirs(trace, exist_ok=True)
        env["CHUNKSERVE_STEP_TRACE"] = os.path.join(trace, "spec.csv" if spec else "plain.csv")
    args = [binary, "serve", "--model", model, "--port", "0", "--openai-port", "0",
            "--threads", str(threads), "--kv-cache-mib", "512"]
    if spec:
        args += ["--speculative", mode, "--num-speculative-tokens", str(drafts)]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    lines = [p.stdout.readline().decode().strip() for _ in range(3)]
    return p, lines[1].split()[-1], lines[2].split()[-1]


def spec_counters(http):
    text = urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("chunkserve:spec_decode_"):
            k, v = line.split()
            out[k.split("spec_decode_")[1].replace("_total", "")] = float(v)
    return out


def one(client, model, prompt, temp, seed, tokens, ignore_eos, stop, gaps, usage, spans, texts,
        i):
    first, last, text = None, None, ""
    for c in client.completions.create(model=model, prompt=prompt, temperature=temp, seed=seed,
                                       max_tokens=tokens, stop=stop, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": ignore_eos}):
        now = time.monotonic()
        if c.usage:
            usage.append(c.usage.completion_tokens)
        if c.choices and c.choices[0].text:
            if last is not None:
                gaps.append(now - last)
            first = first if first is not None else now
            last = now
            text += c.choices[0].text
    spans.append((first, last))
    texts[i] = text


def batch(base, workload, conc, tokens):
    prompt, temp = WORKLOADS[workload]
    client = openai.OpenAI(base_url=f"http://{base}/v1", api_key="none", max_retries=0,
                           timeout=600)
    model = client.models.list().data[0].id
    gaps, usage, spans, texts = [], [], [], [None] * conc
    threads = [threading.Thread(target=one, args=(client, model, prompt, temp, 100 + i, tokens,
                                                   workload in IGNORE_EOS, STOP.get(workload),
                                                   gaps, usage, spans, texts, i))
               for i in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # decode throughput: tokens after each stream's first, over the time from the first
    # first token to the last token (prompt processing left out)
    t0 = min(f for f, _ in spans if f is not None)
    t1 = max(l for _, l in spans if l is not None)
    return sum(u - 1 for u in usage) / max(t1 - t0, 1e-6), gaps, texts


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/bin/chunkserve")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--workloads", default="code,edit,rag,chat")
    ap.add_argument("--spec", default="ngram", help="the speculating server's --speculative")
    ap.add_argument("--trace", help="a folder for each server's step trace (plain.csv, spec.csv)")
    a = ap.parse_args()
    concs = [int(c) for c in a.concurrency.split(",")]
    works = a.workloads.split(",")
    res = {}  # (workload, conc, spec) -> [tok/s per round], gaps
    outs = {}
    acc = {}
    # Both servers stay up (an idle one waits on a futex); each (workload, concurrency)
    # runs its rounds back to back, the two modes alternating which goes first, so the
    # two sides of a per-round ratio are measured seconds apart.
    servers = {spec: start(a.bin, a.model, a.threads, spec, a.drafts, a.spec, a.trace)
               for spec in (False, True)}
    try:
        for w in works:
            for c in concs:
                for r in range(a.rounds):
                    for spec in ((False, True) if r % 2 == 0 else (True, False)):
                        _, http, base = servers[spec]
                        before = spec_counters(http) if spec else None
                        tps, gaps, texts = batch(base, w, c, a.tokens)
                        k = (w, c, spec)
                        res.setdefault(k, ([], []))
                        res[k][0].append(tps)
                        res[k][1].extend(gaps)
                        outs.setdefault((w, c), {})[spec] = texts
                        if spec:
                            after = spec_counters(http)
                            d = {x: after[x] - before.get(x, 0) for x in after}
                            s = acc.setdefault((w, c), [0, 0, 0])
                            s[0] += d["num_drafts"]
                            s[1] += d["num_draft_tokens"]
                            s[2] += d["num_accepted_tokens"]
                    o = outs[(w, c)]
                    if WORKLOADS[w][1] == 0.0 and o[False] != o[True]:
                        print(f"MISMATCH {w} x{c}")
    finally:
        for p, _, _ in servers.values():
            p.terminate()
            p.wait(30)
    print(f"{'workload':8} {'conc':>4} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} "
          f"{'rounds':>11} {'accept':>7} {'len':>5} {'ITL p50/p99/max plain (ms)':>28} "
          f"{'spec (ms)':>20}")
    for w in works:
        for c in concs:
            pl, sp = res[(w, c, False)], res[(w, c, True)]
            mp, ms = statistics.median(pl[0]), statistics.median(sp[0])
            # each round measures both modes back to back: the spread of the per-round
            # ratios is the machine's noise on this comparison
            rr = [b / a for a, b in zip(pl[0], sp[0])]
            spread = f"{min(rr):.2f}-{max(rr):.2f}"
            d, dt, ak = acc[(w, c)]
            g = lambda xs: "/".join(f"{1e3 * pct(xs, q):.0f}" for q in (0.5, 0.99, 1.0))
            print(f"{w:8} {c:>4} {mp:>12.1f} {ms:>11.1f} {ms / mp:>6.2f} {spread:>11} "
                  f"{(ak / dt if dt else 0):>7.2f} {(1 + ak / d if d else 1):>5.2f} "
                  f"{g(pl[1]):>28} {g(sp[1]):>20}")


if __name__ == "__main__":
    main()
