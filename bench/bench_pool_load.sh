#!/bin/sh
# bench_pool_load.sh: one engine's prefill and decode speed with and without
# busy loops beside it (a shared or CPU-throttled machine), for one or two
# builds side by side, alternating so that drift hits both alike.
#
#   bench/bench_pool_load.sh [BIN_A [BIN_B]]
#   HOGS=2 ROUNDS=5 TOKENS=128 MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
#
# Prints one line per run: build, hogs, prompt tok/s, decode tok/s (from the
# CLI's own summary line). Compare medians; the machine is noisy.
set -eu
A=${1:-build/bin/chunkserve}
B=${2:-}
HOGS=${HOGS:-2}
ROUNDS=${ROUNDS:-5}
TOKENS=${TOKENS:-128}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
PROMPT=${PROMPT:-"Write a long story about a cat and a dog who become friends in a small town by the sea."}

hog_pids=""
start_hogs() {
    i=0
    while [ "$i" -lt "$1" ]; do
        sh -c 'while :; do :; done' &
        hog_pids="$hog_pids $!"
        i=$((i + 1))
    done
}
stop_hogs() {
    [ -n "$hog_pids" ] && kill $hog_pids 2>/dev/null || true
    hog_pids=""
}
trap stop_hogs EXIT INT TERM

run() { # BIN LABEL HOGS
    start_hogs "$3"
    line=$("$1" generate --model "$MODEL" --prompt "$PROMPT" --max-tokens "$TOKENS" --ignore-eos 2>&1 >/dev/null |
        grep 'generated' | tail -1)
    stop_hogs
    p=$(echo "$line" | sed -n 's/.*prompt [0-9]* tokens in [0-9.]* s (\([0-9.]*\) tok\/s).*/\1/p')
    d=$(echo "$line" | sed -n 's/.*generated [0-9]* tokens in [0-9.]* s (\([0-9.]*\) tok\/s).*/\1/p')
    echo "$2 hogs=$3 prompt_tok_s=$p decode_tok_s=$d"
}

r=0
while [ "$r" -lt "$ROUNDS" ]; do
    for h in 0 "$HOGS"; do
        run "$A" A "$h"
        [ -n "$B" ] && run "$B" B "$h"
    done
    r=$((r + 1))
done
