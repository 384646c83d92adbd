#!/usr/bin/env bash
# Runs `chunkserve bench-local` on the default model and plots it.
#   bench/bench_local.sh [DURATION_S] [BUDGETS] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/out
build/bin/chunkserve bench-local --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
  --duration "${1:-60}" --budgets "${2:-unlimited,256,512,2048}" --seed "${3:-1}" --out bench/out \
  | tee bench/out/bench_local.txt
python3 bench/plot_bench_local.py bench/out/bench_local.json bench/out/bench_local.png || \
  echo "(plot skipped: pip install matplotlib)"
