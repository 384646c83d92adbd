"""The real default model through chunkserve's Hugging Face path.

tools/gguf_to_hf.py converts the GGUF file into a Hugging Face directory
(config.json, F32 model.safetensors with q/k rows un-permuted, tokenizer.json
with SmolLM2's pre-tokenizer, tokenizer_config.json). Loading that directory
must give the GGUF path's logits bit for bit, the reference tokenizer ids for
every fixture case, and the same chat prompts.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import CLI


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, repo_root, model_path):
    out = tmp_path_factory.mktemp("smollm2-hf")
    subprocess.run([sys.executable, str(repo_root / "tools" / "gguf_to_hf.py"), str(model_path), str(out)],
                   check=True, capture_output=True, timeout=600)
    return out


@pytest.fixture(scope="module")
def cli_hf(chunkserve_bin, hf_dir):
    return CLI(chunkserve_bin, hf_dir)


@pytest.fixture(scope="module")
def fx(fixtures_dir):
    with open(fixtures_dir / "tokenizer_smollm2.json", encoding="utf-8") as f:
        return json.load(f)


def test_logits_identical_to_gguf(cli, cli_hf, tmp_path):
    ids = "1,9690,198,2683,314,260,3575,282,4649,47,2,198,1,520,9531,198"
    a, b = tmp_path / "gguf.f32", tmp_path / "hf.f32"
    cli.run("logits", "--ids", ids, "--out", a)
    cli_hf.run("logits", "--ids", ids, "--out", b)
    la, lb = np.fromfile(a, dtype="<f4"), np.fromfile(b, dtype="<f4")
    assert la.size == 16 * 49152
    assert np.array_equal(la, lb), f"max |diff| {np.abs(la - lb).max()}"


def test_tokenizer_json_matches_reference(cli_hf, fx):
    cases = fx["cases"]
    got = cli_hf.json_lines_out(cli_hf.run("tokenize", stdin=cli_hf.json_lines_in([c["text"] for c in cases])),
                                len(cases))
    bad = [(c["text"], c["ids"], g) for c, g in zip(cases, got) if g != c["ids"]]
    assert not bad, f"{len(bad)}/{len(cases)} differ, first: {bad[:3]!r}"


def test_chat_template_from_tokenizer_config(cli_hf, fx):
    for c in fx["chat_cases"]:
        args = [] if c["add_generation_prompt"] else ["--no-generation-prompt"]
        out = cli_hf.run("chat-format", *args, stdin=json.dumps(c["messages"]).encode())
        assert out.decode() == c["text"]
