#!/usr/bin/env python3
"""Plot a `chunkserve bench serve` report: latency percentiles against the sweep's rate (or
concurrency) with the SLO drawn in, throughput, and the ITL CDF of every point.

    chunkserve bench serve --target HOST:PORT --rates 0.5,1,2,4 --out report.json
    python3 bench/plot_bench_serve.py report.json report.png

Needs matplotlib (a benchmark-only dependency: pip install matplotlib).
"""
import json
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot_bench_serve.py REPORT.json OUT.png")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rep = json.load(open(sys.argv[1]))
    pts = rep["points"]
    closed = "concurrency" in pts[0]
    key = "concurrency" if closed else "rate"
    labels = [str(p[key]) for p in pts]
    x = list(range(len(pts)))
    slo = rep["config"]
    fig, ax = plt.subplots(1, 4, figsize=(20, 4.5))
    for metric, a, limit in (("ttft_ms", ax[0], slo["slo_ttft_p99_ms"]),
                             ("itl_ms", ax[1], slo["slo_itl_p99_ms"])):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^-"), ("max", "x:")):
            a.plot(x, [p[metric][q] for p in pts], style, label=q)
        if limit:
            a.axhline(limit, color="red", lw=1, label="SLO (p99)")
        a.set_yscale("log")
        a.set_xticks(x, labels)
        a.set_xlabel(key + ("" if closed else " [requests/s]"))
        a.set_ylabel(metric.replace("_ms", "").upper() + " [ms]")
        a.legend()
    ax[2].plot(x, [p["output_tok_s"] for p in pts], "o-", label="output tokens/s")
    ax[2].plot(x, [p["total_tok_s"] for p in pts], "s--", label="total tokens/s")
    ax[2].set_xticks(x, labels)
    ax[2].set_xlabel(key)
    ax[2].legend()
    for p, label in zip(pts, labels):
        cdf = p["itl_cdf_ms"]
        if cdf:
            ax[3].plot(cdf, [k / 100 for k in range(101)], label=f"{key} {label}")
    ax[3].set_xscale("log")
    ax[3].set_xlabel("inter-token latency [ms]")
    ax[3].set_ylabel("fraction of gaps")
    ax[3].legend()
    g = rep["goodput"]
    fig.suptitle(f"{rep['model']['name']} at {rep['target']}, workload {slo['workload']}; "
                 f"goodput: {key} {g.get(key)} ({g.get('request_throughput')} requests/s)")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
