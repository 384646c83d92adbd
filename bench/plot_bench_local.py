#!/usr/bin/env python3
"""Plot `chunkserve bench-local --out DIR` results: p50/p99 inter-token latency
and throughput per step budget, and step time against tokens per step.

    python3 bench/plot_bench_local.py bench/out/bench_local.json bench/out/bench_local.png

Needs matplotlib (a benchmark-only dependency: pip install matplotlib).
"""
import json
import sys


def main():
    src, dst = sys.argv[1], sys.argv[2]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.load(open(src))
    runs = d["runs"]
    names = ["unlimited" if r["budget"] == 0 else str(r["budget"]) for r in runs]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    x = range(len(runs))
    ax[0].bar([i - 0.2 for i in x], [r["itl_p50_ms"] for r in runs], 0.4, label="p50")
    ax[0].bar([i + 0.2 for i in x], [r["itl_p99_ms"] for r in runs], 0.4, label="p99")
    ax[0].set_xticks(list(x), names)
    ax[0].set_yscale("log")
    ax[0].set_xlabel("step token budget")
    ax[0].set_ylabel("inter-token latency of chat streams [ms]")
    ax[0].legend()
    ax[1].bar([i - 0.2 for i in x], [r["gen_tok_s"] for r in runs], 0.4, label="generated tok/s")
    ax[1].bar([i + 0.2 for i in x], [r["total_tok_s"] for r in runs], 0.4, label="computed tok/s (prompt + gen)")
    ax[1].set_xticks(list(x), names)
    ax[1].set_xlabel("step token budget")
    ax[1].set_ylabel("tokens / s")
    ax[1].legend()
    for r, n in zip(runs, names):
        pts = r["steps"]
        ax[2].scatter([p[0] for p in pts], [p[1] for p in pts], s=4, label=n)
    ax[2].set_xscale("log")
    ax[2].set_yscale("log")
    ax[2].set_xlabel("tokens in step")
    ax[2].set_ylabel("step time [ms]")
    ax[2].legend()
    fig.suptitle(f"chunkserve bench-local ({d['duration']:.0f} s per budget, seed {d['seed']})")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
