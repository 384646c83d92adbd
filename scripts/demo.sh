#!/usr/bin/env bash
# make demo: stream chat answers from the default model on the CPU reference
# path. (Until the cluster exists, this is the single-process engine.)
set -euo pipefail
BIN=${1:-build/bin}
MODEL=${2:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT

ask() { # question, then extra generate options
  local q=$1; shift
  echo "user: $q"
  printf 'assistant: '
  "$BIN/chunkserve" generate --model "$MODEL" --chat --prompt "$q" "$@" 2>"$LOG" || { cat "$LOG" >&2; exit 1; }
  sed -n 's/.* cli main.c:[0-9]* /  [/p' "$LOG" | sed 's/$/]/'
  echo
}

echo "chunkserve demo: $MODEL (fp32 CPU reference forward pass)"
echo
ask "What is the capital of France, and what is it famous for?" --max-tokens 96
ask "Write a haiku about a cache." --max-tokens 48 --temperature 0.7 --top-p 0.9 --seed 1
