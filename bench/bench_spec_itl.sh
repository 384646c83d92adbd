#!/usr/bin/env bash
# Speculation and the step-time target: `chunkserve serve` with a step-time target, without
# and with `--speculative $SPEC` (ngram, or draft:PATH), loaded by `chunkserve bench serve` (the mixed workload:
# chat beside long RAG and summarize prompts, so prompt chunks share steps with decodes and
# drafts); modes alternate, ROUNDS rounds. Prints TTFT and ITL p50/p99/max and output
# tokens/s per run; the reports land in OUT. Nothing is asserted.
#   bench/bench_spec_itl.sh [MODEL] [OUT]    (TARGET_MS=50 RATE=2 REQUESTS=40 ROUNDS=2 THREADS=2
#                                             SPEC=ngram)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/bin}
MODEL=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${2:-bench-out/spec-itl-$(date +%Y%m%d-%H%M%S)}
TARGET_MS=${TARGET_MS:-50}
RATE=${RATE:-2}
REQUESTS=${REQUESTS:-40}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-2}
SPEC=${SPEC:-ngram}
mkdir -p "$OUT"
lscpu | grep -E 'Model name' >"$OUT/cpu.txt"
run() { # $1 tag, then serve's extra flags
  local tag=$1
  shift
  "$BIN/chunkserve" serve --model "$MODEL" --port 0 --threads "$THREADS" \
    --step-time-target-ms "$TARGET_MS" --kv-cache-mib 512 "$@" >"$OUT/$tag.out" 2>"$OUT/$tag.log" &
  local pid=$!
  for _ in $(seq 600); do
    grep -q '^listening on ' "$OUT/$tag.out" && break
    sleep 0.2
  done
  local addr
  addr=$(sed -n 's/^listening on //p' "$OUT/$tag.out" | head -1)
  "$BIN/chunkserve" bench serve --target "$addr" --workload mixed --rates "$RATE" \
    --requests "$REQUESTS" --seed 1 --slo-ttft-p99-ms 0 --slo-itl-p99-ms 0 --quiet \
    --out "$OUT/$tag.json"
  kill -INT "$pid"
  wait "$pid" || true
}
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then
    run "plain-$r"; run "spec-$r" --speculative "$SPEC"
  else
    run "spec-$r" --speculative "$SPEC"; run "plain-$r"
  fi
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
for p in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    pt = json.load(open(p))["points"][0]
    g = lambda k, s: pt.get(k, {}).get(s)
    print(f"{os.path.basename(p)[:-5]:8s} TTFT p50 {g('ttft_ms', 'p50'):.0f} p99 {g('ttft_ms', 'p99'):.0f} ms | "
          f"ITL p50 {g('itl_ms', 'p50'):.1f} p99 {g('itl_ms', 'p99'):.1f} max {g('itl_ms', 'max'):.1f} ms | "
          f"{pt.get('output_tok_s'):.1f} out tok/s")
PY
