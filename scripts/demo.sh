#!/usr/bin/env bash
# make demo: stream a chat answer from the default model on the CPU reference
# path. (Until the cluster exists, this is the single-process engine.)
set -euo pipefail
BIN=${1:-build/bin}
MODEL=${2:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
Q="What is chunked prefill in LLM serving, in two sentences?"
echo "== chunkserve demo: $MODEL"
echo "== user: $Q"
echo -n "== assistant: "
"$BIN/chunkserve" generate --model "$MODEL" --chat --prompt "$Q" --max-tokens 96
echo "== user: Write a haiku about a cache."
echo -n "== assistant (temperature 0.7, seed 1): "
"$BIN/chunkserve" generate --model "$MODEL" --chat --prompt "Write a haiku about a cache." \
  --max-tokens 48 --temperature 0.7 --top-p 0.9 --seed 1
