"""Qwen2.5-Coder-0.5B Q4_K_M (Q5_0, Q8_0, Q4_K and Q6_K tensors) in quant mode, from the CLI:
`chunkserve logits --engine` gives byte-identical last logits and KV pages for a chunked prompt
and under every CPU kernel set this machine runs (AMX / AVX-512 VNNI / AVX2 / the generic C
reference), so each invariance claimed for the legacy types holds on a real K-quant file too.
(tests/unit/test_quant_engine.c, CTest test_quant_engine_qwen, checks more chunk sizes,
batching and threads.)"""
from __future__ import annotations

import json

import pytest

from conftest import CLI


@pytest.fixture(scope="module")
def qcli(chunkserve_bin, named_model) -> CLI:
    return CLI(chunkserve_bin, named_model("qwen2.5-coder-0.5b"))


@pytest.fixture(scope="module")
def prompt_ids(qcli) -> list[int]:
    text = ("def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n" * 6
            + "Explain what this code does, line by line, and point out any bug.")
    out = qcli.run("tokenize", stdin=qcli.json_lines_in([text]))
    return qcli.json_lines_out(out, 1)[0]


def run(qcli, tmp_path, tag, ids, *flags, env=None):
    out, kv = tmp_path / f"{tag}.f32", tmp_path / f"{tag}.kv"
    qcli.run("logits", "--engine", "--ids", ",".join(map(str, ids)), "--out", out, "--kv-out", kv,
             *flags, timeout=600, env=env)
    return out.read_bytes(), kv.read_bytes()


def test_chunks_and_kernel_sets_are_bitwise_equal(qcli, prompt_ids, tmp_path):
    assert len(prompt_ids) > 150
    base = run(qcli, tmp_path, "one_pass", prompt_ids, "--max-batched-tokens", "0")
    for chunk in (33,):
        assert run(qcli, tmp_path, f"c{chunk}", prompt_ids, "--max-batched-tokens", str(chunk)) \
            == base, f"chunk {chunk} differs from one pass"
    for kernels in ("vnni", "avx2"):
        assert run(qcli, tmp_path, kernels, prompt_ids, "--max-batched-tokens", "0",
                   env={"CHUNKSERVE_CPU_KERNELS": kernels}) == base, \
            f"CHUNKSERVE_CPU_KERNELS={kernels} differs from the default kernels"
    short = prompt_ids[:6]
    fast = run(qcli, tmp_path, "fast", short, "--max-batched-tokens", "4")
    generic = run(qcli, tmp_path, "generic", short, "--max-batched-tokens", "4",
                  env={"CHUNKSERVE_CPU_KERNELS": "generic"})
    assert fast == generic, "the generic C kernels differ from the fast ones"


def test_weights_are_reported_and_kept_at_file_bits(qcli):
    out = qcli.run("info").decode()
    assert "q4_K" in out and "q6_K" in out and "q5_0" in out, out
