#!/usr/bin/env python3
"""Request priority behind a backlog (issue 41): `chunkserve serve` with a step-time target T
gets --backlog long prompts of --long-tokens tokens at once (priority 5, 4 tokens answered
each); once they are queued, --probes short requests arrive one a second, each measured for its
time to first token. The same run is made twice, side by side on one machine: the
probes with priority 0, and with priority 5 (first come, first served). The backlog's own
progress (prompt tokens computed per second) is reported for both, so that priority is seen
to reorder, not to idle, the engine.

    python3 bench/bench_priority.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--backlog 50] [--long-tokens 2000] [--probes 10] [--target-ms 200]

Prints TTFT p50/p99/max of the probes per mode and the goal (priority 0: within 2T).
Numbers only mean something side by side in one run.
"""
import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(bin_dir, model, target_ms, threads):
    p = subprocess.Popen([str(bin_dir / "chunkserve"), "serve", "--model", str(model),
                          "--port", "0", "--http-port", "0", "--openai-port", "0",
                          "--step-time-target-ms", str(target_ms), "--max-queue", "4096",
                          "--kv-cache-mib", "2048", "--threads", str(threads)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = [p.stdout.readline().split()[-1] for _ in range(3)]
    return p, lines[1], lines[2]


def post(http, body, stream=False):
    req = urllib.request.Request(f"http://{http}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=3600)


def ttft(http, model, prompt, priority):
    t0 = time.monotonic()
    with post(http, {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                     "stream": True, "priority": priority}) as r:
        for line in r:
            if line.startswith(b"data: ") and b'"text"' in line:
                return time.monotonic() - t0
    return float("nan")


def metric(ops, name):
    with urllib.request.urlopen(f"http://{ops}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def run(bin_dir, model, args, probe_priority):
    p, ops, http = start(bin_dir, model, args.target_ms, args.threads)
    try:
        with urllib.request.urlopen(f"http://{http}/v1/models", timeout=10) as r:
            name = json.loads(r.read())["data"][0]["id"]
        words = "the quick brown fox jumps over the lazy dog and keeps running".split()
        long_prompt = " ".join(words[i % len(words)] for i in range(args.long_tokens))
        def long_request(i):
            try:
                post(http, {"model": name, "prompt": f"{i} {long_prompt}", "max_tokens": 4,
                            "temperature": 0, "priority": 5}).read()
            except OSError:
                pass  # the server is stopped once the probes are measured
        backlog = [threading.Thread(target=long_request, args=(i,), daemon=True)
                   for i in range(args.backlog)]
        for t in backlog:
            t.start()
        time.sleep(2)  # all queued
        p0, t0 = metric(ops, "chunkserve:prompt_tokens_total"), time.monotonic()
        out = [None] * args.probes

        def probe(k):
            out[k] = ttft(http, name, f"probe {k}: hello there", probe_priority)
        probes = []
        for k in range(args.probes):  # one a second, while the backlog lasts
            probes.append(threading.Thread(target=probe, args=(k,), daemon=True))
            probes[-1].start()
            time.sleep(1)
        for t in probes:
            t.join()
        rate = (metric(ops, "chunkserve:prompt_tokens_total") - p0) / (time.monotonic() - t0)
        preempted = metric(ops, "chunkserve:num_priority_preemptions_total")
        return out, rate, preempted
    finally:
        p.kill()
        p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--bin-dir", default=str(ROOT / "build" / "bin"))
    ap.add_argument("--backlog", type=int, default=50)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--probes", type=int, default=10)
    ap.add_argument("--target-ms", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    bin_dir = Path(args.bin_dir)
    for mode, prio in (("priority 0 (probes first)", 0), ("priority 5 (arrival order)", 5)):
        t, rate, pre = run(bin_dir, args.model, args, prio)
        t.sort()
        p99 = t[min(len(t) - 1, int(0.99 * len(t)))]
        print(f"{mode}: probe TTFT p50 {statistics.median(t) * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms, "
              f"max {t[-1] * 1e3:.0f} ms; backlog prompt tokens/s while probing {rate:.0f}; "
              f"priority preemptions {pre:.0f}")
    print(f"goal: priority-0 probes within 2T = {2 * args.target_ms} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
