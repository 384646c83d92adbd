#!/bin/sh
# Window-aware KV sending (issue 40), side by side: bench/bench_kv_overlap.py on an 8,000-token
# Gemma-3-270M prompt (one prefill + one decode worker, TCP on loopback) with two builds run
# alternately: OLD (a build from before windowed pages were given back: every page of every
# layer sent) and NEW (this tree's build/bin). Reports each run's pages, MiB, prefill+transfer
# time (the prefill's time to first token with the transfer acknowledged), exposed tail and the
# unhidden transfer (the same prompt prefix-cached: all pages at once).
# Usage: bench/bench_window_send.sh OLD_BIN_DIR [ROUNDS] [OUT_DIR]
#   e.g. git worktree add /tmp/old fb94592 && cmake -S /tmp/old -B /tmp/old/build -DCS_CUDA=OFF \
#        && cmake --build /tmp/old/build -j2 --target chunkserve-prefill chunkserve-decode chunkserve
#        bench/bench_window_send.sh /tmp/old/build/bin 6
set -eu
old=$1
rounds=${2:-3}
out=${3:-bench-out/window-send}
mkdir -p "$out"
model=models/gemma-3-270m-Q4_K_M.gguf
r=1
while [ "$r" -le "$rounds" ]; do
    for v in old new; do
        if [ "$v" = old ]; then b=$old; else b=build/bin; fi
        python3 bench/bench_kv_overlap.py --bin "$b" --model "$model" --tokens 8000 --chunk 512 \
            >"$out/$v-r$r.txt" 2>&1
        printf '%s r%s: ' "$v" "$r"
        grep -E 'pages,|prefill \+|exposed|nothing to hide' "$out/$v-r$r.txt" |
            sed -E 's/ \(Prefill call to trailer acknowledged\)//; s/ \(last chunk computed -> trailer acknowledged\)//; s/ \(7984 tokens cached\)//; s/;.*//' |
            tr '\n' '|'
        echo
    done
    r=$((r + 1))
done
