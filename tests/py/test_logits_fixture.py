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
