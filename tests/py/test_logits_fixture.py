"""chunkserve's logits vs the golden fixture (transformers fp32 on the dequantized GGUF).

The fixture tests/fixtures/logits_smollm2.npz is made by tools/fixtures/make_logits_fixture.py;
its docstring describes the contents.  Per prompt we run

  chunkserve logits --model PATH --ids 1,2,3 --out FILE   (raw little-endian f32 [n, n_vocab])

and check, with numpy only:
  * estimated relative L2 error per position  ||R(ours - ref)|| / sqrt(64) / ||ref||  <= 1e-4
    (R: the stored 64 x n_vocab Rademacher matrix; Johnson-Lindenstrauss: est/true has a
    standard deviation of ~1/sqrt(2*64) ~ 9%, so it is within about +-20% of the true value);
  * exact error on the reference top-64 entries, max |ours - ref| / ||ref||            <= 1e-4;
  * exact full relative L2 error on each prompt's last row                            <= 1e-4;
  * identical argmax at every position, except where the reference top1-top2 gap < 1e-3.
The worst figures are printed (pytest -s) and put in the assertion messages.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

FIXTURE_NAME = "logits_smollm2.npz"
EST_REL_L2_MAX = 1e-4
TOPK_REL_MAX = 1e-4
LAST_ROW_REL_L2_MAX = 1e-4
ARGMAX_GAP_MIN = 1e-3


def _load(fixtures_dir):
    with np.load(fixtures_dir / FIXTURE_NAME, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def fx(fixtures_dir) -> dict:
    return _load(fixtures_dir)


@pytest.fixture(scope="module")
def R(fx) -> np.ndarray:
    n_vocab = int(fx["n_vocab"])
    return np.unpackbits(fx["R_bits"], axis=1)[:, :n_vocab].astype(np.float64) * 2.0 - 1.0


def _prompt_names():
    # Collected at import time so every prompt is its own test case.
    from pathlib import Path
    p = Path(__file__).resolve().parents[1] / "fixtures" / FIXTURE_NAME
    with np.load(p, allow_pickle=False) as z:
        return [str(s) for s in z["prompt_names"]]


PROMPTS = _prompt_names()


def compare(fx: dict, R: np.ndarray, i: int, ours: np.ndarray) -> dict:
    """All figures for prompt i; `ours` is float32 [n, n_vocab]."""
    ours64 = ours.astype(np.float64)
    l2 = fx[f"p{i}_l2"]
    k = R.shape[0]
    est = np.linalg.norm(ours64 @ R.T - fx[f"p{i}_sketch"], axis=1) / np.sqrt(k) / l2
    top_ids = fx[f"p{i}_top_ids"]
    top_err = (np.abs(np.take_along_axis(ours64, top_ids.astype(np.int64), axis=1)
                      - fx[f"p{i}_top_vals"].astype(np.float64)).max(axis=1) / l2)
    last = fx[f"p{i}_last"].astype(np.float64)
    last_rel = float(np.linalg.norm(ours64[-1] - last) / np.linalg.norm(last))
    ref_arg, gap = fx[f"p{i}_argmax"], fx[f"p{i}_gap"]
    our_arg = ours.argmax(axis=1)
    argmax_bad = np.nonzero((our_arg != ref_arg) & (gap >= ARGMAX_GAP_MIN))[0]
    return {
        "n": len(l2),
        "est_rel_l2_max": float(est.max()), "est_rel_l2_pos": int(est.argmax()),
        "est_rel_l2_median": float(np.median(est)),
        "top64_rel_max": float(top_err.max()), "top64_rel_pos": int(top_err.argmax()),
        "last_row_rel_l2": last_rel,
        "argmax_mismatch": [(int(p), int(our_arg[p]), int(ref_arg[p]), float(gap[p]))
                            for p in argmax_bad],
        "argmax_mismatch_small_gap": int(((our_arg != ref_arg) & (gap < ARGMAX_GAP_MIN)).sum()),
    }


def test_fixture_is_self_consistent(fx, R):
    """Runs without the binary: the stored sketch/norm/top-k agree with the stored last rows."""
    n_vocab = int(fx["n_vocab"])
    meta = json.loads(str(fx["meta"]))
    assert meta["sketch"]["k"] == R.shape[0] == 64
    assert set(np.unique(R)) == {-1.0, 1.0}
    assert any(len(fx[f"p{i}_ids"]) > 500 for i in range(len(PROMPTS)))
    for i in range(len(PROMPTS)):
        last = fx[f"p{i}_last"]
        assert last.shape == (n_vocab,)
        row = last.astype(np.float64)
        assert np.allclose(R @ row, fx[f"p{i}_sketch"][-1], rtol=1e-9, atol=1e-6)
        assert np.isclose(np.linalg.norm(row), fx[f"p{i}_l2"][-1], rtol=1e-12)
        assert int(last.argmax()) == int(fx[f"p{i}_argmax"][-1])
        assert np.array_equal(last[fx[f"p{i}_top_ids"][-1]], fx[f"p{i}_top_vals"][-1])
        # compare() on rows built from the stored reference data: zero error where it is exact.
        rows = np.zeros((len(fx[f"p{i}_l2"]), n_vocab), dtype=np.float32)
        np.put_along_axis(rows, fx[f"p{i}_top_ids"].astype(np.int64), fx[f"p{i}_top_vals"], axis=1)
        rows[-1] = last
        figs = compare(fx, R, i, rows)
        assert figs["top64_rel_max"] == 0.0 and figs["last_row_rel_l2"] == 0.0
        # sketch of the last row reproduces itself (up to float64 rounding)
        est_last = np.linalg.norm(R @ row - fx[f"p{i}_sketch"][-1]) / 8.0 / fx[f"p{i}_l2"][-1]
        assert est_last < 1e-12


_worst: dict = {}


@pytest.mark.parametrize("name", PROMPTS)
def test_logits_match_reference(cli, fx, R, tmp_path, name):
    i = PROMPTS.index(name)
    ids = fx[f"p{i}_ids"]
    n_vocab = int(fx["n_vocab"])
    out = tmp_path / f"logits_{name}.f32"
    cli.run("logits", "--ids", ",".join(str(int(t)) for t in ids), "--out", out, timeout=900)
    raw = np.fromfile(out, dtype="<f4")
    assert raw.size == len(ids) * n_vocab, (
        f"{out}: {raw.size} floats, expected {len(ids)} x {n_vocab} = {len(ids) * n_vocab}")
    ours = raw.reshape(len(ids), n_vocab)
    assert np.isfinite(ours).all(), "non-finite logits"

    f = compare(fx, R, i, ours)
    summary = (f"[{name}] n={f['n']}: est rel L2 max {f['est_rel_l2_max']:.3e} "
               f"(pos {f['est_rel_l2_pos']}, median {f['est_rel_l2_median']:.3e}); "
               f"top-64 rel max {f['top64_rel_max']:.3e} (pos {f['top64_rel_pos']}); "
               f"last-row rel L2 {f['last_row_rel_l2']:.3e}; "
               f"argmax mismatches {len(f['argmax_mismatch'])} "
               f"(+{f['argmax_mismatch_small_gap']} where gap < {ARGMAX_GAP_MIN})")
    print("\n" + summary)
    for key in ("est_rel_l2_max", "top64_rel_max", "last_row_rel_l2"):
        _worst[key] = max(_worst.get(key, 0.0), f[key])
    print("worst so far over prompts: " + ", ".join(f"{k} {v:.3e}" for k, v in _worst.items()))

    assert f["est_rel_l2_max"] <= EST_REL_L2_MAX, summary
    assert f["top64_rel_max"] <= TOPK_REL_MAX, summary
    assert f["last_row_rel_l2"] <= LAST_ROW_REL_L2_MAX, summary
    assert not f["argmax_mismatch"], (
        summary + "\n(pos, ours, ref, ref gap): " + repr(f["argmax_mismatch"][:10]))


# The engine's quantized kernels (kernels/cpu/qmat.h) on the same prompts. Their error is the
# rounding of activations to int8 per 32-block, so the bounds are statistical: 2x the worse
# of two builds' figures over all 893 positions (docs/perf.md, "Quantized CPU kernels"). An
# AVX-512 build (bench/quant_fidelity.py): rel L2 median 0.0256, p99 0.128, max 0.324;
# KL(ref || ours) over the reference top-64 mean 0.00275, max 0.0325; full-row KL at the
# last positions max 0.00745; top-1 disagreements where the reference's gap >= 0.1: 6 of 820.
# An AVX2 build (this test, 2026-12-03): 0.0252, 0.122, 0.296; 0.00274, 0.0433; 0.0189; 9.
# The builds then differed in the fp32 ops around the GEMM (ops_fast.c: 16 or 8 lanes), and
# the int8 rounding turned such differences into whole quantization steps now and then, so
# the maxima moved between builds more than the medians. Since 2026-12-04 those ops give the
# same bits in every build (tests/unit/test_ops_isa.c), so every build now has the AVX-512
# figures; the bounds were left as they were. (llama.cpp on the same file, from the
# fixture's metadata: rel L2 median 0.022-0.046, max 0.11-0.18.)
QUANT_BOUNDS = {"rel_l2_median": 0.052, "rel_l2_p99": 0.26, "rel_l2_max": 0.65,
                "kl_top64_mean": 0.0055, "kl_top64_max": 0.087, "kl_last_max": 0.038,
                "top1_disagree": 18}


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _engine_logits(cli, fx, i, tmp_path, *flags):
    ids = fx[f"p{i}_ids"]
    out = tmp_path / f"engine_{i}.f32"
    cli.run("logits", "--engine", "--every-position", *flags, "--ids",
            ",".join(str(int(t)) for t in ids), "--out", out, timeout=900)
    return np.fromfile(out, dtype="<f4").reshape(len(ids), int(fx["n_vocab"]))


def test_quantized_kernels_within_calibrated_bounds(cli, fx, R, tmp_path):
    _check_quant_fidelity(cli, fx, R, tmp_path, QUANT_BOUNDS)


def _check_quant_fidelity(cli, fx, R, tmp_path, bounds, *flags):
    l2s, kls, kl_last, disagree = [], [], [], 0
    for i in range(len(PROMPTS)):
        ours = _engine_logits(cli, fx, i, tmp_path, *flags).astype(np.float64)
        assert np.isfinite(ours).all()
        l2 = fx[f"p{i}_l2"]
        l2s.append(np.linalg.norm(ours @ R.T - fx[f"p{i}_sketch"], axis=1) / 8.0 / l2)
        top_ids = fx[f"p{i}_top_ids"].astype(np.int64)
        lp = _log_softmax(fx[f"p{i}_top_vals"].astype(np.float64))
        lq = _log_softmax(np.take_along_axis(ours, top_ids, axis=1))
        kls.append((np.exp(lp) * (lp - lq)).sum(axis=1))
        lp, lq = _log_softmax(fx[f"p{i}_last"].astype(np.float64)), _log_softmax(ours[-1])
        kl_last.append(float((np.exp(lp) * (lp - lq)).sum()))
        sure = fx[f"p{i}_gap"] >= 0.1
        disagree += int((ours.argmax(axis=1) != fx[f"p{i}_argmax"])[sure].sum())
    l2, kl = np.concatenate(l2s), np.concatenate(kls)
    got = {"rel_l2_median": float(np.median(l2)), "rel_l2_p99": float(np.percentile(l2, 99)),
           "rel_l2_max": float(l2.max()), "kl_top64_mean": float(kl.mean()),
           "kl_top64_max": float(kl.max()), "kl_last_max": max(kl_last),
           "top1_disagree": disagree}
    print(f"\nquantized kernels {' '.join(flags)} vs transformers fp32: " +
          ", ".join(f"{k} {v:.3g}" for k, v in got.items()))
    for k, bound in bounds.items():
        assert got[k] <= bound, (k, got, bounds)


def test_exact_engine_matches_reference(cli, fx, R, tmp_path):
    """--exact: the engine's fp32 path (OpenBLAS) keeps <= 1e-4 and argmax equality."""
    for i in range(len(PROMPTS)):
        f = compare(fx, R, i, _engine_logits(cli, fx, i, tmp_path, "--exact"))
        assert f["est_rel_l2_max"] <= EST_REL_L2_MAX, f
        assert f["last_row_rel_l2"] <= LAST_ROW_REL_L2_MAX, f
        assert not f["argmax_mismatch"], f


def test_quantized_engine_is_bitwise_invariant_from_the_cli(cli, fx, tmp_path):
    """`chunkserve logits --engine` (quant mode) on the real model: the last logits and the KV
    pages of a 666-token prompt are byte-identical for every chunk size, 1 or 2 threads, every
    kernel set this CPU runs (AMX tiles, AVX-512 VNNI, AVX2: CHUNKSERVE_CPU_KERNELS=vnni /
    avx2 turn the better ones off; where the CPU lacks one, the run falls to the next and the
    check is weaker, not wrong), and the generic C kernels vs the fast ones
    (CHUNKSERVE_CPU_KERNELS=generic; a short prompt, since the generic path is the scalar
    reference)."""
    i = max(range(len(PROMPTS)), key=lambda k: len(fx[f"p{k}_ids"]))
    ids = ",".join(str(int(t)) for t in fx[f"p{i}_ids"])

    def run(tag, *flags, ids=ids, env=None):
        out, kv = tmp_path / f"{tag}.f32", tmp_path / f"{tag}.kv"
        cli.run("logits", "--engine", "--ids", ids, "--out", out, "--kv-out", kv, *flags,
                timeout=900, env=env)
        return out.read_bytes(), kv.read_bytes()

    base = run("one_pass", "--max-batched-tokens", "0", "--threads", "2")
    for chunk in (1, 2, 15, 16, 17, 64, 100, 256, 512):
        assert run(f"c{chunk}", "--max-batched-tokens", str(chunk), "--threads", "2") == base, \
            f"chunk {chunk} differs from one pass"
    assert run("t1", "--max-batched-tokens", "0", "--threads", "1") == base, "1 thread != 2"
    for kernels in ("vnni", "avx2"):
        assert run(kernels, "--max-batched-tokens", "0", "--threads", "2",
                   env={"CHUNKSERVE_CPU_KERNELS": kernels}) == base, \
            f"CHUNKSERVE_CPU_KERNELS={kernels} differs from the default kernels"
    short = ",".join(ids.split(",")[:8])
    fast = run("fast", "--max-batched-tokens", "3", ids=short)
    generic = run("generic", "--max-batched-tokens", "3", ids=short,
                  env={"CHUNKSERVE_CPU_KERNELS": "generic"})
    assert fast == generic, "generic kernels differ from the fast ones"


# --kv-bf16 on top of the quantized kernels: 2x what bench/quant_fidelity.py measured for it
# (rel L2 median 0.0258, p99 0.146, max 0.277; KL top-64 mean 0.0031, max 0.118; last-row KL
# 0.0116; 11 top-1 disagreements of 820).
QUANT_BF16_BOUNDS = {"rel_l2_median": 0.052, "rel_l2_p99": 0.29, "rel_l2_max": 0.56,
                     "kl_top64_mean": 0.0062, "kl_top64_max": 0.24, "kl_last_max": 0.023,
                     "top1_disagree": 22}


def test_quantized_kernels_with_bf16_kv_within_calibrated_bounds(cli, fx, R, tmp_path):
    _check_quant_fidelity(cli, fx, R, tmp_path, QUANT_BF16_BOUNDS, "--kv-bf16")
