#!/bin/sh
# fuzz-long.sh BUILD_DIR [SECONDS] [TARGET...]: `make fuzz-long`. Runs each
# libFuzzer driver of BUILD_DIR/bin for SECONDS (default 300) of wall time,
# one at a time, niced, on a scratch corpus (BUILD_DIR/test-tmp/fuzz-long/T,
# seeded from the committed corpus, which is only read), and prints per
# target the executions, the final cov:/ft: figures, crash artifacts and
# UBSan reports (UBSan recovers in these builds: reports are counted from the
# log). Exits non-zero when any target crashed or reported undefined
# behaviour; the artifacts and logs stay in the scratch directory.
# TARGET: gguf safetensors tokenizer_json tokenizer_roundtrip chat_template
# wire http_openai kvx_frame kvx_rx_seq (default: all).
set -u
build=${1:?usage: fuzz-long.sh BUILD_DIR [SECONDS] [TARGET...]}
secs=${2:-300}
[ $# -ge 2 ] && shift 2 || shift $#
src=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "$build" && pwd)
bin=$build/bin
out=$build/test-tmp/fuzz-long
targets=${*:-gguf safetensors tokenizer_json tokenizer_roundtrip chat_template wire http_openai kvx_frame kvx_rx_seq}

# The tiny models the model-backed drivers read (what CTest's make_tiny_models writes).
tiny=$out/tiny
mkdir -p "$tiny"
if [ ! -f "$tiny/qwen2/tiny.gguf" ]; then
  "$bin/chunkserve-mktiny" --out "$tiny/f32" --type f32 >/dev/null 2>&1 &&
    "$bin/chunkserve-mktiny" --out "$tiny/qwen2" --qwen2 --type f16 >/dev/null 2>&1 ||
    { echo "fuzz-long: cannot write the tiny models" >&2; exit 2; }
fi
export CS_TINY_DIR=$tiny

failed=0
printf '%-20s %12s %8s %8s %8s %6s  %s\n' target execs exec/s cov ft crashes ubsan
for t in $targets; do
  case $t in
    kvx_frame) corpus=$src/tests/kvx/corpus; max=4096 ;;
    kvx_rx_seq) corpus=$src/tests/kvx/corpus-rx-seq; max=2048 ;;
    http_openai) corpus=$src/tests/fuzz/corpus; max=4096 ;;
    gguf) corpus=$src/tests/fuzz/corpus-$t; max=65536 ;;
    safetensors | tokenizer_json) corpus=$src/tests/fuzz/corpus-$t; max=16384 ;;
    *) corpus=$src/tests/fuzz/corpus-$t; max=4096 ;;
  esac
  exe=$bin/fuzz_${t}_libfuzzer
  if [ ! -x "$exe" ]; then
    echo "fuzz-long: $exe is missing (clang's libFuzzer not found, or an ASan build)" >&2
    failed=1
    continue
  fi
  dir=$out/$t
  rm -rf "$dir" && mkdir -p "$dir/corpus"
  log=$dir/log
  nice -n 10 "$exe" -max_total_time="$secs" -max_len="$max" -timeout=30 -rss_limit_mb=4096 \
    -print_final_stats=1 -artifact_prefix="$dir/" "$dir/corpus" "$corpus" >"$log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -1)
  cov=$(echo "$last" | sed -n 's/.* cov: \([0-9]*\).*/\1/p')
  ft=$(echo "$last" | sed -n 's/.* ft: \([0-9]*\).*/\1/p')
  crashes=$(find "$dir" -maxdepth 1 \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' \
    -o -name 'oom-*' \) | wc -l)
  ub=$(grep -c 'runtime error:' "$log")
  printf '%-20s %12s %8s %8s %8s %6s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "${cov:-?}" \
    "${ft:-?}" "$crashes" "$ub"
  if [ "$rc" != 0 ] || [ "$crashes" != 0 ] || [ "$ub" != 0 ]; then
    failed=1
    echo "  $t: exit $rc; log $log" >&2
    grep -m3 -E 'runtime error:|ERROR: |^fuzz_' "$log" | sed 's/^/  /' >&2
  fi
done
exit $failed
