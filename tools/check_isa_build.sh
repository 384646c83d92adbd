#!/usr/bin/env bash
# check_isa_build.sh: the whole quantized forward pass gives the same bits
# whatever the build targets. Builds `chunkserve` a second time for the
# x86-64 baseline (-DCS_NATIVE=OFF: no AVX, no FMA in the target; the integer
# GEMM's kernels and the fp32 ops' x86-64-v3 clones are picked at run time)
# and compares, with cmp, the last position's logits and the prompt's KV
# pages of `chunkserve logits --engine` against this checkout's default
# build, on the default model: the default kernels and the generic C ones
# (CHUNKSERVE_CPU_KERNELS=generic), fp32 and bf16 KV; a 300-token prompt in
# chunks of 128 (40 tokens with the generic kernels). Not part of `make
# test` (a second build, about a minute on 2 cores); tests/unit/test_ops_isa.c
# checks the fp32 ops against an AVX2 copy and a plain baseline copy (fmaf)
# in every run.
#
#   tools/check_isa_build.sh [BUILD_DIR [MODEL]]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
MODEL=${2:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
ALT=build-x86-64
cmake -S . -B "$ALT" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCS_NATIVE=OFF -DCS_CUDA=OFF \
      -DCS_TESTS=OFF >/dev/null
cmake --build "$ALT" -j2 --target chunkserve >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prompt() { python3 -c "print(','.join(str((j * 37) % 4000 + 5) for j in range($1)))"; }
status=0
for kernels in default generic; do
  for kv in fp32 bf16; do
    # the generic C GEMM is slow: a shorter prompt for it
    ids=$(prompt $([ "$kernels" = generic ] && echo 40 || echo 300))
    args=(logits --model "$MODEL" --engine --ids "$ids" --max-batched-tokens 128)
    [ "$kv" = bf16 ] && args+=(--kv-bf16)
    env=()
    [ "$kernels" = generic ] && env=(CHUNKSERVE_CPU_KERNELS=generic)
    for side in a b; do
      b=$([ $side = a ] && echo "$BUILD" || echo "$ALT")
      if ! env "${env[@]}" "$b/bin/chunkserve" "${args[@]}" --out "$tmp/$side.logits" \
           --kv-out "$tmp/$side.kv" 2>"$tmp/$side.log"; then
        cat "$tmp/$side.log" >&2
        exit 1
      fi
    done
    if cmp -s "$tmp/a.logits" "$tmp/b.logits" && cmp -s "$tmp/a.kv" "$tmp/b.kv"; then
      echo "same bits: $kernels kernels, $kv KV ($BUILD vs $ALT)"
    else
      echo "DIFFERENT: $kernels kernels, $kv KV ($BUILD vs $ALT)"
      status=1
    fi
  done
done
exit $status
