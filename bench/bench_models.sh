#!/usr/bin/env bash
# The real-model figures of docs/perf.md ("Real models: K-quants"), in one run:
#   1. per model (SmolLM2-135M Q4_1, Qwen2.5-Coder-0.5B and -1.5B Q4_K_M): prefill of
#      512 tokens and decode, chunkserve next to llama.cpp (llama-cpp-python) on the same file
#      and thread count, alternated rounds, medians (bench/bench_single.py);
#   2. per model: `chunkserve bench-engine` (decode step at batch 1 / 8 / 32 against the
#      weights' and KV bytes over the copy bandwidth it measures, prefill against the int8
#      peak it measures);
#   3. on the 1.5B: `chunkserve serve` and `chunkserve cluster up` (1 prefill + 1 decode),
#      each with a 300 ms step-time target, loaded by `chunkserve bench serve` with a chat
#      workload (closed loop) and a RAG-like one (1,500-token prompts, JSONL).
# Nothing is asserted; everything lands in OUT (default bench-out/models-<date>).
#   bench/bench_models.sh [BIN_DIR] [OUT]     (ROUNDS=3 THREADS=2 SKIP_SERVE=1 to trim;
#                                              SERVE_ONLY=1 runs step 3 alone)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-build/bin}
OUT=${2:-bench-out/models-$(date +%Y%m%d-%H%M%S)}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-2}
mkdir -p "$OUT"
MODELS=(smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b)
lscpu | grep -E 'Model name|Flags' | sed 's/Flags:.*\(avx512_vnni\|amx_int8\).*/&/' | cut -c1-200 >"$OUT/cpu.txt"

[ -n "${SERVE_ONLY:-}" ] && MODELS=()
for name in "${MODELS[@]}"; do
  scripts/fetch-model.sh "$name"
  m=$(python3 scripts/fetch_model.py --path "$name")
  extra=()
  [ "$name" = qwen2.5-coder-1.5b ] && extra=(--no-exact)
  echo "== $name: bench_single" >&2
  python3 bench/bench_single.py --bin "$BIN/chunkserve" --model "$m" --threads "$THREADS" \
    --repeat "$ROUNDS" "${extra[@]}" | tee "$OUT/single-$name.txt"
  echo "== $name: bench-engine" >&2
  "$BIN/chunkserve" bench-engine --model "$m" --threads "$THREADS" --prompt-tokens 512 \
    2>"$OUT/engine-$name.log" | tee "$OUT/engine-$name.txt"
done

[ -n "${SKIP_SERVE:-}" ] && exit 0
m=$(python3 scripts/fetch_model.py --path qwen2.5-coder-1.5b)
python3 - "$OUT/rag.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(6):
        f.write(json.dumps({"prompt_tokens": 1500, "output_tokens": 32}) + "\n")
PY
serve_bench() { # $1 tag, $2 target
  "$BIN/chunkserve" bench serve --target "$2" --workload chat --arrival closed --concurrency 4 \
    --requests 12 --seed 1 --slo-ttft-p99-ms 0 --slo-itl-p99-ms 0 --out "$OUT/$1-chat.json" \
    2>>"$OUT/$1-bench.log"
  "$BIN/chunkserve" bench serve --target "$2" --workload "$OUT/rag.jsonl" --arrival closed \
    --concurrency 2 --requests 6 --seed 1 --slo-ttft-p99-ms 0 --slo-itl-p99-ms 0 \
    --out "$OUT/$1-rag.json" 2>>"$OUT/$1-bench.log"
}
start() { # $1 tag, then the command; waits for "listening on", prints the address
  local tag=$1
  shift
  "$@" >"$OUT/$tag.out" 2>"$OUT/$tag.log" &
  echo $! >"$OUT/$tag.pid"
  for _ in $(seq 600); do
    grep -q '^listening on ' "$OUT/$tag.out" && break
    sleep 0.5
  done
  sed -n 's/^listening on //p' "$OUT/$tag.out" | head -1
}
stop() { kill -INT "$(cat "$OUT/$1.pid")" 2>/dev/null || true; wait "$(cat "$OUT/$1.pid")" 2>/dev/null || true; }

echo "== qwen2.5-coder-1.5b: serve" >&2
addr=$(start serve "$BIN/chunkserve" serve --model "$m" --port 0 --threads "$THREADS" \
  --step-time-target-ms 300 --kv-cache-mib 512)
serve_bench serve "$addr"
curl -s "http://$(sed -n 's/^http listening on //p' "$OUT/serve.out" | head -1)/metrics" >"$OUT/serve-metrics.txt" || true
stop serve

echo "== qwen2.5-coder-1.5b: cluster up 1+1" >&2
# the workers read their flags' CHUNKSERVE_* variables (cluster up has no flag for this one)
addr=$(CHUNKSERVE_STEP_TIME_TARGET_MS=300 start cluster "$BIN/chunkserve" cluster up --model "$m" \
  --prefill 1 --decode 1 --port 0 --prefill-threads 1 --decode-threads 1 --kv-cache-mib 512)
serve_bench cluster "$addr"
grep -E 'http ' "$OUT/cluster.out" | sed 's/.*(http \([^,]*\),.*/\1/' | while read -r h; do
  curl -s "http://$h/metrics" | grep -E '^chunkserve:kv_transfer' >>"$OUT/cluster-metrics.txt" || true
done
stop cluster
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
for tag in ("serve", "cluster"):
    for wl in ("chat", "rag"):
        p = os.path.join(out, f"{tag}-{wl}.json")
        if not os.path.exists(p):
            continue
        r = json.load(open(p))
        pt = r["points"][0]
        def g(k, s):
            v = pt.get(k, {})
            return v.get(s) if isinstance(v, dict) else None
        print(f"{tag:8s} {wl:5s} TTFT p50 {g('ttft_ms','p50')} p99 {g('ttft_ms','p99')} ms | "
              f"ITL p50 {g('itl_ms','p50')} p99 {g('itl_ms','p99')} max {g('itl_ms','max')} ms | "
              f"{pt.get('output_tok_s')} out tok/s")
PY
