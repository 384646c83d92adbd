#!/usr/bin/env python3
"""Plots the timeline tests/py/test_autoscale.py writes (autoscale.csv): replicas per pool,
each pool's signal against its HPA target, and the load in flight, over test seconds
(1 test second = 10 HPA seconds).
Usage: plot_autoscale.py [autoscale.csv] [docs/img/autoscale.png]   (needs matplotlib)"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src = sys.argv[1] if len(sys.argv) > 1 else "docs/img/autoscale.csv"
dst = sys.argv[2] if len(sys.argv) > 2 else "docs/img/autoscale.png"
rows = list(csv.DictReader(open(src)))
t = [float(r["t"]) for r in rows]


def col(name):
    return [float(r[name]) if r[name] not in ("", "None") else float("nan") for r in rows]


def spans(phase):
    """(start, end) of each run of rows in the phase."""
    out, start = [], None
    for ti, r in zip(t, rows):
        if r["phase"] == phase and start is None:
            start = ti
        elif r["phase"] != phase and start is not None:
            out.append((start, ti))
            start = None
    if start is not None:
        out.append((start, t[-1]))
    return out


fig, axes = plt.subplots(4, 1, figsize=(11, 10), sharex=True,
                         gridspec_kw=dict(height_ratios=[1, 1, 1, 0.8]))
for ax in axes:
    for a, b in spans("A"):
        ax.axvspan(a, b, color="tab:orange", alpha=0.10, lw=0)
    for a, b in spans("B"):
        ax.axvspan(a, b, color="tab:purple", alpha=0.10, lw=0)
    ax.grid(alpha=0.3)

ax = axes[0]
ax.step(t, col("prefill_replicas"), where="post", color="tab:orange", lw=2, label="prefill replicas")
ax.step(t, col("decode_replicas"), where="post", color="tab:purple", lw=2, label="decode replicas")
ax.step(t, col("prefill_ready"), where="post", color="tab:orange", lw=1, ls=":", label="prefill in DNS")
ax.step(t, col("decode_ready"), where="post", color="tab:purple", lw=1, ls=":", label="decode in DNS")
ax.set_ylabel("replicas")
ax.set_ylim(0, max(col("prefill_replicas") + col("decode_replicas")) + 1)
ax.legend(loc="upper right", fontsize=8, ncol=2)
ax.set_title("HPA on real /metrics: long prompts (orange band) scale prefill, "
             "long generations (purple band) scale decode", fontsize=10)

ax = axes[1]
target = col("prefill_target")
ax.plot(t, col("prefill_queued_tokens"), color="tab:orange", label="sum queued_prefill_tokens (prefill pool)")
ax.step(t, [a * b for a, b in zip(target, col("prefill_replicas"))], where="post", color="black",
        lw=1, ls="--", label="target x replicas (rate x backlog per replica)")
ax.set_ylabel("tokens")
ax.legend(loc="upper right", fontsize=8)

ax = axes[2]
kv_t = col("kv_target")
ax.plot(t, col("decode_kv_usage_sum"), color="tab:purple", label="sum kv_cache_usage_perc (decode pool)")
ax.step(t, [a * b for a, b in zip(kv_t, col("decode_replicas"))], where="post", color="black", lw=1,
        ls="--", label="0.8 x replicas")
ax.set_ylabel("KV usage")
ax2 = ax.twinx()
ax2.plot(t, col("router_waiting"), color="tab:red", lw=1, label="router num_requests_waiting")
ax2.set_ylabel("waiting", color="tab:red")
ax2.set_ylim(0, max([1.0] + [w for w in col("router_waiting") if w == w]) * 1.25)
h1, l1 = ax.get_legend_handles_labels()
h2, l2 = ax2.get_legend_handles_labels()
ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)

ax = axes[3]
ax.plot(t, col("load_long_prompts"), color="tab:orange", label="long prompts in flight")
ax.plot(t, col("load_long_generations"), color="tab:purple", label="long generations in flight")
ax.plot(t, col("load_trickle"), color="tab:gray", label="trickle in flight")
ax.set_ylabel("requests")
ax.set_xlabel("test seconds (x10 = HPA seconds)")
ax.legend(loc="upper right", fontsize=8)

fig.tight_layout()
fig.savefig(dst, dpi=110)
print(f"wrote {dst}")
