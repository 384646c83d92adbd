#!/usr/bin/env bash
# make demo: a 1 prefill + 1 decode worker cluster behind the router on this
# host (`chunkserve cluster up`), a long-document question and concurrent chats
# through the gRPC API and one chat streamed through the OpenAI-compatible HTTP
# API with the official `openai` client (scripts/demo.py), then the cluster is
# stopped.
set -euo pipefail
BIN=${1:-build/bin}
MODEL=${2:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
PORT=${CHUNKSERVE_DEMO_PORT:-0}
OUT=$(mktemp) LOG=$(mktemp)
cleanup() {
  if [ -n "${PID:-}" ] && kill -0 "$PID" 2>/dev/null; then kill -INT "$PID"; wait "$PID" || true; fi
  rm -f "$OUT" "$LOG"
}
trap cleanup EXIT

echo "chunkserve demo: starting a 1+1 cluster on $MODEL (logs: $LOG)"
"$BIN/chunkserve" cluster up --model "$MODEL" --prefill 1 --decode 1 --port "$PORT" --openai-port 0 \
  >"$OUT" 2>"$LOG" &
PID=$!
for _ in $(seq 600); do
  grep -q '^listening on ' "$OUT" && break
  kill -0 "$PID" 2>/dev/null || { cat "$LOG" >&2; echo "demo: the cluster did not start" >&2; exit 1; }
  sleep 0.2
done
grep -q '^listening on ' "$OUT" || { cat "$LOG" >&2; echo "demo: the cluster did not start in 120 s" >&2; exit 1; }
sed '/^listening on /d' "$OUT"
ADDR=$(sed -n 's/^listening on //p' "$OUT")
OPENAI=$(sed -n 's/^openai listening on //p' "$OUT")
HTTP=$(sed -n 's/^  \(prefill\|decode\) .*(http \([^,]*\),.*/\2/p' "$OUT" | sed 's|^|http://|')
python3 scripts/demo.py --addr "$ADDR" --openai "http://$OPENAI/v1" --http $HTTP
echo
echo "stopping the cluster"
kill -INT "$PID"
wait "$PID"
PID=
