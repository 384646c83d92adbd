#!/usr/bin/env bash
# build-image.sh: builds the CPU image from deploy/docker/Dockerfile.cpu without a
# Docker daemon, then checks it. `make image` runs it.
#
#   1. base: `debootstrap --variant=minbase bookworm`, slimmed the way the official
#      debian:bookworm-slim is (dpkg path excludes for docs/man/locales) and brought
#      up to date from bookworm-updates and bookworm-security, imported into buildah
#      as docker.io/library/debian:bookworm-slim, the name the Dockerfile's FROM uses,
#      so the build never pulls from a registry (`--pull=never`). Made once, reused.
#   2. build: `buildah bud` (vfs storage, chroot isolation), timed.
#   3. checks, from inside the image: the image config (user 10001, tini entrypoint,
#      default command, ports, labels); `ldd` of every binary finds every library;
#      the binaries carry no AVX-512 / AVX code (no -march=native leaked in); each
#      binary's --help through tini; a 1 prefill + 1 decode `chunkserve cluster up`
#      answering a greedy gRPC request from a grpcio client on the host (buildah's
#      chroot isolation shares the host network) with the text `chunkserve generate`
#      gives in the same image; a clean exit on SIGTERM.
#   4. prints the image size and the build time.
#
# Not here: pushing the image anywhere, and the CUDA image (its nvidia/cuda base
# comes from a registry this machine cannot reach).
#
# Needs root (buildah with vfs storage, debootstrap), buildah and debootstrap
# (installed with apt-get when missing), python3 with grpcio + grpcio-tools
# (requirements-test.txt) for the gRPC check.
#
# Environment:
#   CS_IMAGE          image name (default localhost/chunkserve:cpu)
#   CS_IMAGE_DIR      buildah storage, base rootfs, logs (default /var/tmp/cs-image);
#                     several GB with vfs: keep it out of the work tree
#   CS_DOCKERFILE     the recipe (default deploy/docker/Dockerfile.cpu)
#   CS_IMAGE_REF      build a commit (git archive REF) instead of the work tree, e.g. HEAD
#   CS_IMAGE_C_FLAGS  extra C flags for the build (--build-arg CS_C_FLAGS), e.g.
#                     -march=x86-64-v4 for AVX-512 nodes; skips the portability check
#   CS_IMAGE_JOBS     compile jobs in the build stage (default 2)
#   CS_IMAGE_MODEL    model for the cluster check (default: the SmolLM2 model in
#                     models/ when fetched, else a tiny model from
#                     build/bin/chunkserve-mktiny)
#   CS_IMAGE_REBASE=1 remake the debootstrap base
#   CS_IMAGE_SKIP_BUILD=1  check the existing image only
#   CS_CPU_LOCK       flock file around the CPU-heavy build (default /tmp/cs-cpu.lock)
#   CS_DEBIAN_MIRROR  (default http://deb.debian.org/debian)
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD

IMAGE=${CS_IMAGE:-localhost/chunkserve:cpu}
DIR=${CS_IMAGE_DIR:-/var/tmp/cs-image}
DOCKERFILE=${CS_DOCKERFILE:-deploy/docker/Dockerfile.cpu}
JOBS=${CS_IMAGE_JOBS:-2}
LOCK=${CS_CPU_LOCK:-/tmp/cs-cpu.lock}
MIRROR=${CS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE=docker.io/library/debian:bookworm-slim
BINS=(chunkserve chunkserve-router chunkserve-prefill chunkserve-decode)

say() { printf 'build-image: %s\n' "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }

if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || die "needs root (buildah vfs storage, debootstrap)"
  exec sudo -E "$0" "$@"
fi
missing=()
command -v buildah >/dev/null || missing+=(buildah)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
python3 -c 'import grpc, grpc_tools' 2>/dev/null \
  || die "python3 needs grpcio and grpcio-tools (pip install -r requirements-test.txt)"

mkdir -p "$DIR"
bh() { buildah --root "$DIR/storage" --runroot "$DIR/run" --storage-driver vfs "$@"; }
export BUILDAH_ISOLATION=chroot

# ---- 1. the base image -------------------------------------------------------------
make_base() {
  local root=$DIR/rootfs t0 t1 ctr mnt
  t0=$(date +%s)
  rm -rf "$root"
  say "debootstrap --variant=minbase bookworm ($MIRROR)"
  debootstrap --variant=minbase bookworm "$root" "$MIRROR" >"$DIR/debootstrap.log" 2>&1 \
    || { tail -20 "$DIR/debootstrap.log" >&2; die "debootstrap failed (log: $DIR/debootstrap.log)"; }
  # What debuerreotype's slimify does for the official -slim images.
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/man/*
EOF
  find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$root/usr/share/groff"/* "$root/usr/share/info"/* "$root/usr/share/linda"/* \
         "$root/usr/share/lintian/overrides"/* "$root/usr/share/man"/*
  find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
  cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  printf 'Acquire::Languages "none";\n' >"$root/etc/apt/apt.conf.d/docker-no-languages"
  printf 'APT::AutoRemove::SuggestsImportant "false";\n' >"$root/etc/apt/apt.conf.d/docker-autoremove-suggests"
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: ${MIRROR}
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${MIRROR%/debian}/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  mount -t proc proc "$root/proc"
  if ! chroot "$root" sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get upgrade -y -qq' \
       >>"$DIR/debootstrap.log" 2>&1; then
    umount "$root/proc"; die "apt-get upgrade in the base failed (log: $DIR/debootstrap.log)"
  fi
  umount "$root/proc"
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log \
         "$root"/var/cache/debconf/*-old "$root"/var/lib/dpkg/*-old "$root"/dev/* "$root"/tmp/*
  # The base's package set: tests/deploy/test_dockerfiles.py counts on exactly these
  # (deploy/docker/base-packages.txt) being present without an apt-get install.
  chroot "$root" dpkg-query -W -f '${Package}\n' | sort >"$DIR/base-packages.txt"
  if bh inspect --type image "$BASE" >/dev/null 2>&1; then bh rmi -f "$BASE" >/dev/null; fi
  ctr=$(bh from scratch)
  mnt=$(bh mount "$ctr")
  tar -C "$root" --numeric-owner -cf - . | tar -C "$mnt" --numeric-owner -xpf -
  bh umount "$ctr" >/dev/null
  bh config --os linux --arch amd64 --cmd '["bash"]' \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  bh commit --rm -q "$ctr" "$BASE" >/dev/null
  t1=$(date +%s)
  say "base $BASE made in $((t1 - t0)) s ($(wc -l <"$DIR/base-packages.txt") packages)"
}

if [ "${CS_IMAGE_REBASE:-0}" = 1 ] || ! bh inspect --type image "$BASE" >/dev/null 2>&1 \
   || [ ! -s "$DIR/base-packages.txt" ]; then
  make_base
else
  say "reusing base $BASE (CS_IMAGE_REBASE=1 remakes it)"
fi
# The committed list must not claim a package the base lacks.
claimed=$(grep -v '^#' deploy/docker/base-packages.txt | sort -u || true)
absent=$(comm -23 <(echo "$claimed") "$DIR/base-packages.txt")
[ -z "$absent" ] || die "deploy/docker/base-packages.txt lists packages the base lacks: $absent"
extra=$(comm -13 <(echo "$claimed") "$DIR/base-packages.txt")
[ -z "$extra" ] || say "note: the base also has (not in base-packages.txt): $(echo $extra)"

# ---- 2. the build --------------------------------------------------------------------
BUILD_S=
if [ "${CS_IMAGE_SKIP_BUILD:-0}" != 1 ]; then
  revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
  version=$(git describe --tags --always --dirty 2>/dev/null || echo dev)
  context=.
  if [ -n "${CS_IMAGE_REF:-}" ]; then
    context=$DIR/context
    rm -rf "$context"
    mkdir -p "$context"
    git archive --format=tar "$CS_IMAGE_REF" | tar -C "$context" -xf -
    cp .dockerignore "$context/"
    revision=$(git rev-parse "$CS_IMAGE_REF")
    version=$(git describe --tags --always "$CS_IMAGE_REF" 2>/dev/null || echo dev)
  fi
  say "buildah bud -f $DOCKERFILE -t $IMAGE, context ${CS_IMAGE_REF:-the work tree} (waiting for $LOCK)"
  # Timed from when the lock is held: waiting for other builds is not build time.
  rm -f "$DIR/build.start"
  flock "$LOCK" sh -c 'date +%s.%N >"$0"; exec "$@"' "$DIR/build.start" \
    buildah --root "$DIR/storage" --runroot "$DIR/run" --storage-driver vfs \
    bud --pull=never --isolation chroot --layers=false \
    --build-arg JOBS="$JOBS" --build-arg CS_C_FLAGS="${CS_IMAGE_C_FLAGS:-}" \
    --build-arg VERSION="$version" --build-arg REVISION="$revision" \
    --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    -f "$DOCKERFILE" -t "$IMAGE" "$context" >"$DIR/build.log" 2>&1 \
    || { tail -40 "$DIR/build.log" >&2; die "image build failed (log: $DIR/build.log)"; }
  t1=$(date +%s.%N)
  t0=$(cat "$DIR/build.start")
  BUILD_S=$(python3 -c "print(f'{$t1 - $t0:.0f}')")
  say "built $IMAGE in ${BUILD_S} s (log: $DIR/build.log)"
  # Builds leave dangling intermediate images behind with vfs: drop them.
  bh rmi --prune >/dev/null 2>&1 || true
fi

# ---- 3. checks -----------------------------------------------------------------------
bh inspect --type image "$IMAGE" >/dev/null 2>&1 || die "no image $IMAGE"
bh inspect --type image "$IMAGE" | python3 -c '
import json, sys
c = json.load(sys.stdin)["OCIv1"]["config"]
errs = []
def want(what, got, exp):
    if got != exp:
        errs.append(f"{what}: {got!r} != {exp!r}")
want("User", c.get("User"), "10001:10001")
want("Entrypoint", c.get("Entrypoint"), ["/usr/bin/tini", "--"])
want("Cmd", c.get("Cmd"), ["chunkserve", "--help"])
want("ExposedPorts", sorted(c.get("ExposedPorts", {})), ["50050/tcp", "50051/tcp", "50060/tcp", "50070/tcp"])
labels = c.get("Labels") or {}
for k in ("title", "description", "version", "revision", "created", "base.name"):
    if not labels.get("org.opencontainers.image." + k):
        errs.append("missing label org.opencontainers.image." + k)
if errs:
    sys.exit("image config: " + "; ".join(errs))
' || die "image config"
say "ok: config (user 10001, tini entrypoint, CMD chunkserve --help, ports, OCI labels)"

CTR=
CLUSTER_PID=
# Every process below pid $1 (ppid links, read from /proc).
descendants() {
  local -A kids=()
  local st pid ppid rest out=() queue=("$1")
  for st in /proc/[0-9]*/stat; do
    read -r pid _ _ ppid rest <"$st" 2>/dev/null || continue
    kids[$ppid]+=" $pid"
  done
  while [ ${#queue[@]} -gt 0 ]; do
    pid=${queue[0]}; queue=("${queue[@]:1}")
    for rest in ${kids[$pid]:-}; do out+=("$rest"); queue+=("$rest"); done
  done
  echo "${out[@]:-}"
}
cleanup() {
  if [ -n "$CLUSTER_PID" ]; then
    # buildah does not pass signals on to the container's processes: stop them all
    # (collected first: killed parents reparent their children to init).
    local pids
    pids=$(descendants "$CLUSTER_PID")
    kill -KILL $pids "$CLUSTER_PID" 2>/dev/null || true
    wait "$CLUSTER_PID" 2>/dev/null || true
  fi
  [ -z "$CTR" ] || bh rm "$CTR" >/dev/null 2>&1 || true
}
trap cleanup EXIT
CTR=$(bh from --pull=never -q "$IMAGE")

uid=$(bh run "$CTR" -- id -u)
[ "$uid" = 10001 ] || die "runs as uid $uid, not 10001"

lddout=$(bh run "$CTR" -- sh -c 'for b in /usr/local/bin/*; do echo "== $b"; ldd "$b" || echo "ldd failed"; done')
for b in "${BINS[@]}"; do
  grep -qx "== /usr/local/bin/$b" <<<"$lddout" || die "/usr/local/bin/$b missing from the image"
done
if grep -E 'not found|ldd failed' <<<"$lddout" >&2; then die "ldd in the image: libraries not found"; fi
say "ok: ldd finds every library of $(grep -c '^== ' <<<"$lddout") binaries in /usr/local/bin"

# No -march=native: the image must run on any x86-64 (AVX-512 zmm / AVX ymm registers
# would mean the build used the build machine's CPU).
if [ -z "${CS_IMAGE_C_FLAGS:-}" ]; then
  mnt=$(bh mount "$CTR")
  for b in "${BINS[@]}"; do
    n=$(objdump -d --no-show-raw-insn "$mnt/usr/local/bin/$b" | grep -cE '%[yz]mm[0-9]' || true)
    [ "$n" = 0 ] || die "$b has $n AVX/AVX-512 instructions: built for the build machine's CPU?"
  done
  bh umount "$CTR" >/dev/null
  say "ok: no AVX/AVX-512 instructions in the binaries (portable x86-64)"
else
  say "skipped the portability check: built with CS_C_FLAGS=$CS_IMAGE_C_FLAGS"
fi

for b in "${BINS[@]}"; do
  out=$(bh run "$CTR" -- /usr/bin/tini -s -- "$b" --help 2>&1) || die "$b --help failed: $out"
  grep -q '^usage: ' <<<"$out" || die "$b --help printed no usage: $out"
done
say "ok: --help of ${BINS[*]} through tini"

# The model for the cluster check: a directory mounted read-only at /models.
MODEL=${CS_IMAGE_MODEL:-}
if [ -z "$MODEL" ] && [ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
fi
MODELDIR=$DIR/model
rm -rf "$MODELDIR"
mkdir -p "$MODELDIR"
if [ -n "$MODEL" ]; then
  cp "$MODEL" "$MODELDIR/model.gguf"
else
  [ -x build/bin/chunkserve-mktiny ] \
    || die "no model: fetch it (scripts/fetch-model.sh), build build/bin/chunkserve-mktiny, or set CS_IMAGE_MODEL"
  build/bin/chunkserve-mktiny --out "$MODELDIR/tiny" >/dev/null
  mv "$MODELDIR/tiny/tiny.gguf" "$MODELDIR/model.gguf"
  rm -rf "$MODELDIR/tiny"
  MODEL="tiny random-weight model (chunkserve-mktiny)"
fi
chmod -R a+rX "$MODELDIR"
PROMPT="The capital of France is"

bh run -v "$MODELDIR:/models:ro" "$CTR" -- /usr/bin/tini -s -- chunkserve generate \
  --model /models/model.gguf --prompt "$PROMPT" --max-tokens 8 --threads 1 \
  >"$DIR/generate.out" 2>"$DIR/generate.err" || { cat "$DIR/generate.err" >&2; die "chunkserve generate in the image"; }

PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
say "cluster up in the image: 1 prefill + 1 decode, router on 127.0.0.1:$PORT, model: $MODEL"
# --local-prefill-threshold 0: every prompt goes through the prefill worker and its
# KV pages over TCP to the decode worker, the disaggregated path.
buildah --root "$DIR/storage" --runroot "$DIR/run" --storage-driver vfs \
  run -v "$MODELDIR:/models:ro" "$CTR" -- /usr/bin/tini -s -- chunkserve cluster up \
  --model /models/model.gguf --prefill 1 --decode 1 --port "$PORT" \
  --prefill-threads 1 --decode-threads 1 --local-prefill-threshold 0 --kv-cache-mib 64 \
  --grace-ms 2000 >"$DIR/cluster.out" 2>"$DIR/cluster.err" &
CLUSTER_PID=$!
for _ in $(seq 1200); do
  grep -q '^listening on ' "$DIR/cluster.out" 2>/dev/null && break
  kill -0 "$CLUSTER_PID" 2>/dev/null || { tail -20 "$DIR/cluster.err" >&2; die "cluster up exited while starting"; }
  sleep 0.1
done
grep -q '^listening on ' "$DIR/cluster.out" || { tail -20 "$DIR/cluster.err" >&2; die "cluster up did not listen within 120 s"; }
reply=$(python3 deploy/docker/grpc_check.py --addr "127.0.0.1:$PORT" --prompt "$PROMPT" \
          --max-tokens 8 --want-file "$DIR/generate.out") \
  || { tail -20 "$DIR/cluster.err" >&2; die "gRPC Generate against the cluster in the image"; }
say "ok: gRPC Generate through the router in the image: $reply"
say "ok: equals \`chunkserve generate\` in the image: $(head -c 200 "$DIR/generate.out" | tr '\n' ' ')"

# SIGTERM to tini, as Kubernetes sends it to a container's first process (buildah
# itself would kill the container's processes without a grace); tini forwards it.
tini_pid=
for p in $(descendants "$CLUSTER_PID"); do
  [ "$(cat "/proc/$p/comm" 2>/dev/null)" = tini ] && { tini_pid=$p; break; }
done
[ -n "$tini_pid" ] || die "no tini process under buildah run"
kill -TERM "$tini_pid"
rc=0
for _ in $(seq 300); do kill -0 "$CLUSTER_PID" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$CLUSTER_PID" 2>/dev/null; then die "cluster up still running 30 s after SIGTERM"; fi
wait "$CLUSTER_PID" || rc=$?
CLUSTER_PID=
[ "$rc" = 0 ] || { tail -20 "$DIR/cluster.err" >&2; die "cluster up exited $rc on SIGTERM"; }
left=$(ps -eo pid=,args= | grep -E 'chunkserve(-router|-prefill|-decode)? .*--model[= ]/models/model\.gguf' | grep -v grep || true)
[ -z "$left" ] || die "processes left after the cluster stopped: $left"
say "ok: cluster stopped cleanly on SIGTERM (exit 0)"

# ---- 4. size and time ------------------------------------------------------------------
# Uncompressed: what buildah reports (decimal MB); compressed: the gzip'ed layers a
# registry stores and a node pulls (the image written as an OCI archive).
size=$(bh images --json "$IMAGE" | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["size"])')
base_size=$(bh images --json "$BASE" | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["size"])')
rm -f "$DIR/image.oci.tar"
bh push -q --compression-format gzip "$IMAGE" "oci-archive:$DIR/image.oci.tar" >/dev/null 2>&1 \
  || bh push -q "$IMAGE" "oci-archive:$DIR/image.oci.tar" >/dev/null
packed=$(stat -c %s "$DIR/image.oci.tar")
rm -f "$DIR/image.oci.tar"
printf 'image: %s (%s)\n' "$IMAGE" "$(bh inspect --type image --format '{{.FromImageID}}' "$IMAGE" | cut -c1-12)"
printf 'image size: %s uncompressed, %.1f MB compressed (OCI archive, gzip layers); base %s: %s\n' \
  "$size" "$(python3 -c "print($packed / 1e6)")" "$BASE" "$base_size"
[ -z "$BUILD_S" ] || printf 'build time: %s s (buildah bud, cold, JOBS=%s, %s CPUs; base made once and reused)\n' \
  "$BUILD_S" "$JOBS" "$(nproc)"
