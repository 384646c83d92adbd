"""Shared pytest fixtures for chunkserve's process-level tests.

Environment:
  CHUNKSERVE_BIN_DIR  directory holding the built binaries (default <repo>/build/bin)
  CHUNKSERVE_MODEL    the default model (default <repo>/models/SmolLM2-135M-Instruct.Q4_1.gguf)

Tests that need a binary are skipped, with the reason, when it has not been built.  A missing
model is a failure, not a skip: CI always fetches it (scripts/fetch-model.sh).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES_DIR = REPO_ROOT / "tests" / "fixtures"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES_DIR


@pytest.fixture(scope="session")
def bin_dir() -> Path:
    return Path(os.environ.get("CHUNKSERVE_BIN_DIR", REPO_ROOT / "build" / "bin")).resolve()


@pytest.fixture(scope="session")
def chunkserve_bin(bin_dir: Path) -> Path:
    """Path of the `chunkserve` CLI; skips the test if it has not been built."""
    exe = bin_dir / "chunkserve"
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        pytest.skip(f"chunkserve CLI not built: {exe} missing (build with "
                    f"`cmake -S . -B build && cmake --build build -j`, or set CHUNKSERVE_BIN_DIR)")
    return exe


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model; a missing model fails (CI always fetches it)."""
    p = Path(os.environ.get("CHUNKSERVE_MODEL",
                            REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not p.is_file():
        pytest.fail(f"model not found: {p} (run scripts/fetch-model.sh or set CHUNKSERVE_MODEL)")
    return p


# Models fetched by name (scripts/fetch-model.sh NAME): `make test` fetches the ones in
# REQUIRED_MODELS, so a missing one fails; the others (benchmark models) skip.
REQUIRED_MODELS = {"qwen2.5-coder-0.5b", "gemma3-270m"}


def named_model_path(name: str) -> Path:
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import fetch_model
    models = Path(os.environ.get("CHUNKSERVE_MODELS_DIR", REPO_ROOT / "models"))
    return models / fetch_model.MODELS[name]["file"]


@pytest.fixture(scope="session")
def named_model():
    """named_model("qwen2.5-coder-0.5b") -> its path; fails (required) or skips when absent."""
    def get(name: str) -> Path:
        p = named_model_path(name)
        if not p.is_file():
            msg = f"model {name} not found: {p} (run scripts/fetch-model.sh {name})"
            if name in REQUIRED_MODELS:
                pytest.fail(msg)
            pytest.skip(msg)
        return p
    return get


def run_cli(exe: Path, args: list, stdin: bytes = b"", timeout: float = 300,
            env: dict | None = None) -> bytes:
    """Run the CLI, fail the test with its stderr on a non-zero exit; return stdout bytes.
    env: variables added to this process's environment for the run."""
    cmd = [str(exe), *[str(a) for a in args]]
    try:
        proc = subprocess.run(cmd, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout, env={**os.environ, **env} if env else None)
    except subprocess.TimeoutExpired:
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}")
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}: {' '.join(cmd)}\n"
                    f"stderr:\n{proc.stderr.decode('utf-8', 'replace')[-4000:]}")
    return proc.stdout


def json_lines_in(values, ensure_ascii: bool = False) -> bytes:
    """Encode values as JSON lines (one JSON value per line, '\\n' terminated)."""
    return "".join(json.dumps(v, ensure_ascii=ensure_ascii) + "\n" for v in values).encode("utf-8")


def json_lines_out(out: bytes, expected_count: int) -> list:
    """Parse JSON-lines output; splits on '\\n' only (U+2028 etc. may appear raw in strings)."""
    text = out.decode("utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(lines) == expected_count, (
        f"expected {expected_count} output lines, got {len(lines)}; first lines: {lines[:3]!r}")
    return [json.loads(line) for line in lines]


class CLI:
    """The `chunkserve` CLI bound to one model: cli.run("tokenize", stdin=...) etc."""

    json_lines_in = staticmethod(json_lines_in)
    json_lines_out = staticmethod(json_lines_out)

    def __init__(self, exe: Path, model: Path):
        self.exe, self.model = exe, model

    def run(self, subcommand: str, *args, stdin: bytes = b"", timeout: float = 300,
            env: dict | None = None) -> bytes:
        return run_cli(self.exe, [subcommand, "--model", self.model, *args], stdin, timeout, env)


@pytest.fixture(scope="session")
def cli(chunkserve_bin: Path, model_path: Path) -> CLI:
    return CLI(chunkserve_bin, model_path)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "tiny: uses only the tiny random-weight model (fast; `make test` also runs "
                   "these against the ASan build with `-m tiny`)")
    config.addinivalue_line(
        "markers", "cluster: the router and workers as separate processes (or fake workers) on "
                   "loopback")
    config.addinivalue_line(
        "markers", "emu: the cluster on the emulated CUDA backend with the NCCL payload over a "
                   "loopback NCCL stand-in (tests/py/test_cluster_emu.py; CTest cluster_emu)")
    config.addinivalue_line(
        "markers", "chaos: random kills, stops and partitions under load (tests/py/test_chaos.py; "
                   "CTest chaos, about 4 minutes)")
    config.addinivalue_line(
        "markers", "deploy: credential rotation with real processes (tests/py/test_rotation.py; "
                   "CTest rotation, label deploy)")
    config.addinivalue_line(
        "markers", "autoscale: the HPA algorithm scaling real worker pools behind the router "
                   "(tests/py/test_autoscale.py; root, about 1.5 minutes)")


def pytest_collection_modifyitems(config, items):
    # A test that uses a fixture named `tiny` or `tiny_model` and no real model is a tiny test.
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & {"tiny", "tiny_model"} and not names & {"model_path", "real", "cli"}:
            item.add_marker(pytest.mark.tiny)


PROTOS = ["chunkserve/v1/generation.proto", "chunkserve/v1/cluster.proto",
          "chunkserve/v1/echo.proto", "grpc/health/v1/health.proto"]


@pytest.fixture(scope="session")
def proto_modules(tmp_path_factory) -> dict:
    """Python modules generated with grpcio-tools from proto/ (the real client
    side of the tests): echo_pb2(_grpc), generation_pb2(_grpc), cluster_pb2(_grpc),
    health_pb2."""
    protoc = pytest.importorskip("grpc_tools.protoc")
    out = tmp_path_factory.mktemp("stubs")
    include = Path(protoc.__file__).parent / "_proto"
    for p in PROTOS:  # one file at a time so a failure names it
        rc = protoc.main(["grpc_tools.protoc", f"-I{REPO_ROOT / 'proto'}", f"-I{include}",
                          f"--python_out={out}", f"--grpc_python_out={out}", p])
        assert rc == 0, f"grpc_tools.protoc failed on {p}"
    sys.path.insert(0, str(out))
    try:
        mods = {n: importlib.import_module(f"chunkserve.v1.{n}")
                for n in ("echo_pb2", "echo_pb2_grpc", "generation_pb2", "generation_pb2_grpc",
                          "cluster_pb2", "cluster_pb2_grpc")}
    finally:
        sys.path.remove(str(out))
    # grpc/health/v1/health_pb2.py would shadow the grpc package if imported as
    # grpc.health...: load the message module on its own and call by method path.
    spec = importlib.util.spec_from_file_location("cs_health_pb2",
                                                  out / "grpc" / "health" / "v1" / "health_pb2.py")
    mods["health_pb2"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mods["health_pb2"])
    return mods
