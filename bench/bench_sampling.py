#!/usr/bin/env python3
"""Single-stream decode speed by sampling settings: greedy, temperature alone, and the
filters (top-p, top-k, min-p) that clients send, e.g. Qwen2.5's own recommended
settings (T 0.7, top-p 0.8, top-k 20). On a 152k-token vocabulary the sampler's cost is
a visible part of a decode step; this measures it where it shows, in decode tok/s.

Each round runs `chunkserve generate` once per setting (and per binary with
--baseline-bin, alternating), a fixed prompt, --ignore-eos, and reads the decode rate
from its last log line. Reports the median per setting and binary and the spread.
Nothing here asserts a speed.

  python3 bench/bench_sampling.py --model models/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf \
      [--bin build/bin/chunkserve] [--baseline-bin OLD] [--rounds 3] [--tokens 128]
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess

SETTINGS = [
    ("greedy", []),
    ("T 0.7", ["--temperature", "0.7"]),
    ("T 0.7, top-p 0.95", ["--temperature", "0.7", "--top-p", "0.95"]),
    ("T 0.7, top-p 0.8, top-k 20", ["--temperature", "0.7", "--top-p", "0.8", "--top-k", "20"]),
    ("T 1.0, min-p 0.05", ["--temperature", "1.0", "--min-p", "0.05"]),
]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
RATE = re.compile(r"generated (\d+) tokens in ([0-9.]+) s \(([0-9.]+) tok/s\)")


def one(binary: str, model: str, threads: int, tokens: int, args: list[str]) -> float:
    out = subprocess.run(
        [binary, "generate", "--model", model, "--threads", str(threads), "--prompt", PROMPT,
         "--chat", "--max-tokens", str(tokens), "--ignore-eos", "--seed", "7", *args],
        capture_output=True, text=True, timeout=1800, check=True)
    m = RATE.search(out.stderr + out.stdout)
    if not m:
        raise SystemExit(f"no decode rate in the output of {binary}: {out.stderr[-400:]}")
    return float(m.group(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/bin/chunkserve")
    ap.add_argument("--baseline-bin", help="another chunkserve (e.g. the last commit's build)")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    bins = [("this", a.bin)] + ([("baseline", a.baseline_bin)] if a.baseline_bin else [])
    rates: dict[tuple[str, str], list[float]] = {}
    for r in range(a.rounds):
        order = bins if r % 2 == 0 else bins[::-1]
        for name, args in SETTINGS:
            for label, binary in order:
                rates.setdefault((name, label), []).append(one(binary, a.model, a.threads, a.tokens, args))
    print(f"model {a.model}, {a.threads} threads, {a.tokens} tokens, {a.rounds} rounds (decode tok/s)")
    head = "| setting | " + " | ".join(f"{l} median (spread)" for l, _ in bins)
    head += " | this / baseline |" if len(bins) > 1 else " |"
    print(head)
    print("|" + " --- |" * (len(bins) + 1 + (len(bins) > 1)))
    for name, _ in SETTINGS:
        cells = []
        for label, _ in bins:
            v = rates[(name, label)]
            cells.append(f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})")
        row = f"| {name} | " + " | ".join(cells)
        if len(bins) > 1:
            row += f" | {statistics.median(rates[(name, 'this')]) / statistics.median(rates[(name, 'baseline')]):.2f}x"
        print(row + " |")


if __name__ == "__main__":
    main()
