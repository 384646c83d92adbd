"""What tools/fixtures/make_greedy_fixture.py, tests/py/test_greedy_fixture.py and
bench/quant_fidelity_qwen.py share: the greedy fixtures' format, the near-tie rule and the
fidelity figures (numpy only, no test framework).

A fixture (tests/fixtures/greedy_<model>.json) holds, per prompt, the prompt's token ids,
the reference greedy continuation (transformers fp32, eager attention, KV cache) of
`n_gen` tokens with, per step, the reference's top-2 id and top1 - top2 logit margin, and
for the prompt's last position (the logits that choose the first generated token) the
top-64 ids and logits, the row's L2 norm and a 128-row Rademacher sketch S = R @ row.

R is defined by code, not by an RNG stream: R[k, j] = +1 if the top bit of
splitmix64(seed + k * n_vocab + j) is set, else -1 (uint64 arithmetic, wrapping). The
fixture stores the sha256 of np.packbits(R > 0) so a reader can check its R is the same.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

NEAR_TIE = 0.01  # a greedy divergence counts only where the reference margin is >= this
SKETCH_K = 128
SKETCH_SEED = 0x5EED_C0DE_0000_0001
TOP_K = 64

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 output function of the counter x (uint64 array), wrapping."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def rademacher(k: int, n: int, seed: int = SKETCH_SEED) -> np.ndarray:
    """int8 [k, n] of +-1 (see the module docstring)."""
    j = np.arange(n, dtype=np.uint64)
    out = np.empty((k, n), dtype=np.int8)
    for r in range(k):
        with np.errstate(over="ignore"):
            z = splitmix64(np.uint64(seed) + np.uint64(r) * np.uint64(n) + j)
        out[r] = np.where((z >> np.uint64(63)) != 0, 1, -1).astype(np.int8)
    return out


def rademacher_sha256(R: np.ndarray) -> str:
    return hashlib.sha256(np.packbits(R > 0, axis=1).tobytes()).hexdigest()


def sketch(R: np.ndarray, row: np.ndarray) -> np.ndarray:
    """R @ row in float64, R int8 [k, n], row [n] (any float type)."""
    x = np.asarray(row, dtype=np.float64)
    out = np.empty(R.shape[0], dtype=np.float64)
    for a in range(0, R.shape[0], 16):  # 16 rows at a time: bounded memory
        out[a:a + 16] = R[a:a + 16].astype(np.float64) @ x
    return out


def load(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def last_position_figures(p: dict, R: np.ndarray, ours: np.ndarray) -> dict:
    """One prompt's last-position logits `ours` [n_vocab] against the fixture entry p:
    rel_l2 (Johnson-Lindenstrauss estimate ||R(ours - ref)|| / sqrt(k) / ||ref||; est/true has
    a standard deviation of about 1/sqrt(2k) = 6% at k = 128), kl_top64 = KL(ref || ours) over
    the reference's top-64 ids (both renormalised over them), top1 = ours' argmax."""
    last = p["last"]
    o = np.asarray(ours, dtype=np.float64)
    rel = float(np.linalg.norm(sketch(R, o) - np.asarray(last["sketch"])) /
                np.sqrt(R.shape[0]) / last["l2"])
    ids = np.asarray(last["top_ids"], dtype=np.int64)
    lp, lq = log_softmax(np.asarray(last["top_vals"])), log_softmax(o[ids])
    return {"rel_l2": rel, "kl_top64": float((np.exp(lp) * (lp - lq)).sum()),
            "top1": int(o.argmax()), "top1_ref": int(p["greedy"][0])}


def greedy_verdict(p: dict, ours, near_tie: float = NEAR_TIE) -> dict:
    """The near-tie rule for one prompt: ours (generated ids) must equal the reference greedy
    ids up to the first position where they differ, and the reference's top1 - top2 margin
    there must be < near_tie; after that position nothing is compared. A shorter `ours` than
    the reference is a failure (unless it diverged before its end)."""
    ref, margin = p["greedy"], p["margin"]
    n = len(ref)
    first = next((i for i in range(min(n, len(ours))) if int(ours[i]) != ref[i]), None)
    if first is None:
        ok = len(ours) >= n
        return {"ok": ok, "first_diff": None, "margin": None, "n_equal": min(n, len(ours)),
                "why": "" if ok else f"only {len(ours)} of {n} tokens"}
    m = float(margin[first])
    return {"ok": m < near_tie, "first_diff": first, "margin": m, "n_equal": first,
            "ours": int(ours[first]), "ref": ref[first], "ref_top2": p["top2"][first],
            "why": "" if m < near_tie else
            f"diverged at step {first}: ours {int(ours[first])}, reference {ref[first]} "
            f"(its top-2 {p['top2'][first]}), reference margin {m:.4g} >= {near_tie}"}


def teacher_forced_figures(p: dict, argmax_per_step, near_tie: float = NEAR_TIE) -> dict:
    """Per greedy step, an engine's argmax given the reference's prefix (prompt + reference
    tokens before the step) against the reference's top-1. first_diff: the first step where
    they differ, which is where that engine's own free-running greedy output would leave the
    reference's; agree: steps (of n_gen) where they are equal; agree_sure / n_sure: the same
    over steps whose reference margin is >= near_tie."""
    ref = np.asarray(p["greedy"])
    ours = np.asarray(argmax_per_step)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    margin = np.asarray(p["margin"])
    eq = ours == ref
    sure = margin >= near_tie
    diff = np.nonzero(~eq)[0]
    first = int(diff[0]) if diff.size else None
    return {"agree": int(eq.sum()), "n": int(eq.size), "agree_sure": int(eq[sure].sum()),
            "n_sure": int(sure.sum()), "first_diff": first,
            "first_diff_margin": float(margin[first]) if first is not None else None}
