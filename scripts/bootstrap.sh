#!/usr/bin/env bash
# Installs what chunkserve's build and tests need on Debian 12, idempotently:
# Debian packages with apt-get (as root, or through sudo) and the Python test
# requirements with pip. Fast when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(build-essential cmake pkg-config git python3 python3-pip
      libcjson-dev libopenblas-dev libxxhash-dev libuv1-dev
      libgrpc-dev libssl-dev libprotobuf-c-dev protobuf-c-compiler libhttp-parser-dev
      openssl iproute2)  # the tests: certificates (test_tls.py), network namespaces (test_netns.py)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing ${missing[*]}" >&2
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "bootstrap: need root or sudo to install ${missing[*]}" >&2; exit 1; }
    SUDO=sudo
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python test requirements (pytest, numpy, grpcio, ...): install only when missing.
if ! python3 - <<'PY' 2>/dev/null
import importlib.metadata as md, re, sys
for line in open("requirements-test.txt"):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name = re.split(r"[<>=!~ ;\[]", line, 1)[0]
    md.version(name)
PY
then
  echo "bootstrap: installing Python test requirements" >&2
  python3 -m pip install --quiet --disable-pip-version-check -r requirements-test.txt
fi
