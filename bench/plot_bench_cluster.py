#!/usr/bin/env python3
"""Plots bench/bench_cluster.py's JSON: per configuration the chat streams' ITL
p50/p99, the long prompts' TTFT p50/p99, output tokens/s, the ITL distribution
and the ITL of every chat token over time with the long prompts' arrivals.
Usage: plot_bench_cluster.py [bench/out/bench_cluster.json] [docs/img/bench_cluster.png]"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src = sys.argv[1] if len(sys.argv) > 1 else "bench/out/bench_cluster.json"
dst = sys.argv[2] if len(sys.argv) > 2 else "docs/img/bench_cluster.png"
d = json.load(open(src))
runs = d["runs"]
a = d["args"]
names = [r["name"] for r in runs]
colors = {"serve-512": "tab:blue", "serve-unlimited": "tab:red", "cluster": "tab:green"}
col = [colors.get(n, "tab:gray") for n in names]

fig = plt.figure(figsize=(13, 8.5))
gs = fig.add_gridspec(2, 3, height_ratios=[1, 1.15])


def bars(ax, key, stats, scale, title, unit, log=False):
    w = 0.8 / len(stats)
    for j, s in enumerate(stats):
        vals = [r[key][s] * scale for r in runs]
        xs = [i + (j - (len(stats) - 1) / 2) * w for i in range(len(runs))]
        b = ax.bar(xs, vals, w, color=col, alpha=1.0 if j == len(stats) - 1 else 0.45,
                   edgecolor="black", linewidth=0.5)
        for x, v in zip(xs, vals):
            ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=7)
        b.set_label(s)
    ax.set_xticks(range(len(runs)), names, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit)
    if log:
        ax.set_yscale("log")
    top = max(r[key][stats[-1]] * scale for r in runs)
    if not log:
        ax.set_ylim(0, top * 1.15)
    else:
        ax.set_ylim(top=top * 2)


ax = fig.add_subplot(gs[0, 0])
bars(ax, "itl_ms", ["p50", "p99"], 1, "chat inter-token latency [light: p50, dark: p99]", "ms", log=True)
ax = fig.add_subplot(gs[0, 1])
bars(ax, "long_ttft_s", ["p50", "p99"], 1,
     "long prompts' TTFT [light: p50, dark: p99]", "s")
ax = fig.add_subplot(gs[0, 2])
vals = [r["output_tok_s"] for r in runs]
ax.bar(range(len(runs)), vals, 0.6, color=col, edgecolor="black", linewidth=0.5)
for i, v in enumerate(vals):
    ax.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=8)
ax.set_xticks(range(len(runs)), names, fontsize=8)
ax.set_ylim(0, max(vals) * 1.15)
ax.set_title("output tokens/s (chats + long)", fontsize=10)
ax.set_ylabel("tok/s")

ax = fig.add_subplot(gs[1, 0])
for r, c in zip(runs, col):
    xs = sorted(x for _, x in r["itl_samples"])
    if xs:
        ax.plot([max(x, 1e-1) for x in xs], [1 - i / len(xs) for i in range(len(xs))], color=c, label=r["name"])
ax.set_xscale("log")
ax.set_yscale("log")
ax.axhline(0.01, color="gray", lw=0.6, ls=":")
ax.set_xlabel("chat inter-token gap [ms]")
ax.set_ylabel("fraction of gaps longer")
ax.set_title("ITL distribution (1% line = p99)", fontsize=10)
ax.legend(fontsize=7)

ax = fig.add_subplot(gs[1, 1:])
for r, c in zip(runs, col):
    s = r["itl_samples"]
    ax.scatter([t for t, _ in s], [max(x, 1e-1) for _, x in s], s=3, color=c, alpha=0.35, label=r["name"],
               rasterized=True)
for t, n in d["long_schedule"]:
    ax.axvline(t, color="black", lw=0.6, ls="--")
    ax.annotate(f"{n}", (t, 0.01), xycoords=("data", "axes fraction"), fontsize=6, rotation=90, va="bottom",
                ha="right")
ax.set_yscale("log")
ax.set_xlabel("seconds into the run (dashed: a long prompt arrives, its token count)")
ax.set_ylabel("gap to previous token [ms]")
ax.set_title("every chat token's inter-token gap over time", fontsize=10)
ax.legend(fontsize=7, markerscale=4, loc="upper right")

fig.suptitle(f"SmolLM2-135M on {a['threads']} cores: {a['streams']} chat streams + long prompts (seed {a['seed']}, "
             f"{a['duration']:g} s per config): one process (serve) vs 1 prefill + 1 decode worker (cluster)",
             fontsize=10)
fig.tight_layout()
fig.savefig(dst, dpi=110)
print(f"wrote {dst}")
