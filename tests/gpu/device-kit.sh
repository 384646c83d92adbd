#!/usr/bin/env bash
# tests/gpu/device-kit.sh: run HERE (a Debian 12 machine with network and the
# default model) before tests/gpu/device-check.sh runs on a lent GPU machine.
# That machine has CUDA, CMake and a compiler but none of the engine's
# libraries, no network, and a call carries at most 64 MiB, less than the
# default model. This writes the ignored folder .devkit/:
#   deps.tar.xz  the engine's libraries from Debian 12's packages (cJSON,
#                OpenBLAS pthread + libgfortran/libquadmath, xxHash: headers,
#                shared objects, .pc files) and pkgconf, unpacked there under
#                /tmp/cs-devdeps and found through PKG_CONFIG_SYSROOT_DIR
#   model.1      the default model's first 52,000,000 bytes
#   model.2      the rest
# Then two device calls, the second within the machine's warm window (30 s)
# so that it finds the first one's build and model half (device-check.sh's
# header has the exact calls).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$MODEL" ] || scripts/fetch-model.sh
mkdir -p .devkit
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PKGS=(libcjson-dev libcjson1 libopenblas-dev libopenblas0 libopenblas0-pthread libopenblas-pthread-dev
      libgfortran5 libquadmath0 libxxhash-dev libxxhash0 pkgconf pkgconf-bin libpkgconf3)
(cd "$tmp" && apt-get download "${PKGS[@]}" >/dev/null 2>&1) || {
  echo "device-kit: apt-get download ${PKGS[*]} failed (Debian's package mirror unreachable?)" >&2
  exit 1
}
mkdir "$tmp/root"
for f in "$tmp"/*.deb; do dpkg -x "$f" "$tmp/root"; done
# only what a build and a run need: no static archives, LAPACK, docs
find "$tmp/root" \( -name '*.a' -o -name 'liblapack*' -o -name 'libblas*' \) -delete
rm -rf "$tmp/root/usr/share/doc" "$tmp/root/usr/share/man" "$tmp/root/usr/share/lintian" \
  "$tmp/root/usr/share/bug" "$tmp/root/usr/share/aclocal" "$tmp/root/usr/lib/x86_64-linux-gnu/blas"
tar cJf .devkit/deps.tar.xz -C "$tmp/root" usr
head -c 52000000 "$MODEL" >.devkit/model.1
tail -c +52000001 "$MODEL" >.devkit/model.2
cat .devkit/model.1 .devkit/model.2 | cmp -s - "$MODEL"
ls -l .devkit
echo "device-kit: ready; the device calls are in tests/gpu/device-check.sh's header" >&2
