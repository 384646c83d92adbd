"""pytest set-up for the deploy checks (tests/deploy): the Helm chart in
deploy/helm/chunkserve, rendered and validated offline (test_chart.py), and the
container recipes in deploy/docker (test_dockerfiles.py).

Environment:
  CHUNKSERVE_BIN_DIR  directory holding the built binaries (default <repo>/build/bin)
  CS_UPDATE_GOLDEN=1  rewrite tests/deploy/golden/*.yaml from the current chart
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def bin_dir() -> Path:
    return Path(os.environ.get("CHUNKSERVE_BIN_DIR", REPO_ROOT / "build" / "bin")).resolve()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "deploy: the Helm chart and the container recipes checked offline (no cluster, "
                   "no Docker daemon); CTest label deploy")


def pytest_collection_modifyitems(config, items):
    # Every test in this folder is a deploy check.
    here = Path(__file__).resolve().parent
    for item in items:
        if Path(str(item.fspath)).resolve().parent == here:
            item.add_marker(pytest.mark.deploy)
