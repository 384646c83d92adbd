#!/bin/sh
# The two autoscaling signals on the same bursty load (issue 41, item 4): runs
# tests/py/test_autoscale.py (real router and workers, the HPA algorithm on a compressed clock,
# phase A long prompts for the prefill pool, phase B long generations for the decode pool;
# needs root for its mount namespace) ROUNDS times, queue and predictive alternately, and
# prints, per pool and signal, the time from its load's start to 2 replicas, the
# replica-seconds asked for, and the TTFTs of its load (p50, p99, over 1 s): median and range
# over the rounds. Each round's timelines (autoscale-SIGNAL.csv: bench/plot_autoscale.py draws
# one) and summaries stay in OUT_DIR/rN. LOAD: phase A as closed loops of 3 clients (closed,
# a step), or as open-loop arrivals whose rate grows linearly to twice a replica's nominal rate
# (ramp: the load a leading signal is for). BACKLOG_S: the queue signal's prefill target in
# seconds of a replica's work (the test's 0.25 by default; the chart's default is 2).
# Usage: bench/bench_autoscale.sh [ROUNDS] [OUT_DIR] [closed|ramp] [BACKLOG_S]
set -eu
rounds=${1:-3}
out=${2:-bench-out/autoscale}
export CS_AUTOSCALE_PHASE_A=${3:-closed}
export CS_AUTOSCALE_BACKLOG_S=${4:-0.25}
mkdir -p "$out"
r=1
while [ "$r" -le "$rounds" ]; do
    for sig in queue predictive; do
        mkdir -p "$out/r$r"
        CS_AUTOSCALE_OUT_DIR="$out/r$r" python3 -m pytest -q -p no:cacheprovider \
            tests/py/test_autoscale.py -k "$sig" >"$out/r$r/pytest-$sig.txt" 2>&1 ||
            echo "round $r, $sig: the test failed (see $out/r$r/pytest-$sig.txt)"
    done
    r=$((r + 1))
done
python3 - "$out" <<'PY'
import glob, json, statistics, sys
runs = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/r*/autoscale-*.json")):
    j = json.load(open(f))
    runs.setdefault(j["signal"], []).append(j)
if not runs:
    sys.exit(f"no autoscale-*.json under {sys.argv[1]}: every round failed")
keys = ("react_s", "replica_seconds", "ttft_p50_s", "ttft_p99_s", "ttft_misses")
for pool in ("prefill", "decode"):
    first = next(iter(runs.values()))[0]
    load = (f"long prompts, {first.get('phase_a', 'closed')}, queue target {first.get('backlog_s', 0.25)} s"
            if pool == "prefill" else "long generations")
    print(f"{pool} pool (its load: {load})")
    for sig, js in runs.items():
        cells = []
        for k in keys:
            v = [j[pool][k] for j in js if j[pool][k] is not None]
            cells.append(f"{k} {statistics.median(v):g} [{min(v):g}..{max(v):g}]" if v else f"{k} -")
        print(f"  {sig:10} ({len(js)} rounds): " + ", ".join(cells))
PY
