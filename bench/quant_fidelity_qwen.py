#!/usr/bin/env python3
"""How far chunkserve (quant mode, --exact) and llama.cpp are from transformers fp32 on the
Qwen2.5-Coder greedy fixtures (K-quant GGUFs).

The reference is tests/fixtures/greedy_<model>.json (tools/fixtures/make_greedy_fixture.py:
transformers fp32 on the GGUF's dequantized weights, 8 prompts, 48 greedy steps each; the
format is in tests/py/greedy_fixture_lib.py). Engines:

  quant   chunkserve logits --engine           the file's blocks, integer kernels (default)
  exact   chunkserve logits --engine --exact   fp32 weights dequantized as gguf does (OpenBLAS)
  llama   llama-cpp-python Llama(model_path, logits_all=True): eval(ids), its logits rows
          (use_extra_bufts off: its AMX path crashes here, see run_llama)

Figures, per prompt and over all:
  rel_l2     relative L2 error of the prompt's last-position logits (the row that picks the
             first generated token), estimated from the fixture's 128-row Rademacher sketch
             (Johnson-Lindenstrauss; est/true has a standard deviation of about 6%)
  kl_top64   KL(ref || engine) over the reference's top-64 ids at that position (both
             renormalised over those ids)
  top1       teacher-forced greedy steps: the engine's argmax given the prompt + the
             reference's tokens before the step, against the reference top-1, at all 48
             steps (agree / n) and at the steps whose reference margin is >= 0.01; the first
             step where they differ is where that engine's own greedy output leaves the
             reference's (it is the same computation up to there), given with the
             reference's margin at it
chunkserve's teacher-forced rows come from `logits --engine --every-position` on the prompt
+ the reference's first 47 tokens (one token a step, as generation decodes); llama.cpp's
from one eval of the same ids with logits_all.

  python3 bench/quant_fidelity_qwen.py --fixture tests/fixtures/greedy_qwen2.5-coder-0.5b.json
      [--model models/...gguf] [--bin build/bin] [--modes quant,exact,llama] [--threads 2]
      [--json out.json]
(0.5B: about 2 min for quant, 5 for exact, 1 for llama.cpp on 2 cores; 1.5B about 3x.)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "py"))
import greedy_fixture_lib as lib  # noqa: E402


def chunkserve_rows(bin_dir, model, ids, flags, tmp, every_position):
    out = os.path.join(tmp, "l.f32")
    cmd = [os.path.join(bin_dir, "chunkserve"), "logits", "--model", model, "--engine",
           "--ids", ",".join(str(int(t)) for t in ids), "--out", out, *flags]
    if every_position:
        cmd.append("--every-position")
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    rows = np.fromfile(out, dtype="<f4")
    os.unlink(out)
    return rows


def run_chunkserve(a, fx, flags, tmp):
    V = fx["n_vocab"]
    res = []
    for p in fx["prompts"]:
        t0 = time.time()
        last = chunkserve_rows(a.bin, a.model, p["ids"], flags, tmp, False).reshape(V)
        seq = p["ids"] + p["greedy"][:-1]
        rows = chunkserve_rows(a.bin, a.model, seq, flags, tmp, True).reshape(len(seq), V)
        steps = rows[len(p["ids"]) - 1:]
        res.append((last, steps.argmax(axis=1)))
        print(f"  {p['name']}: {time.time() - t0:.1f} s", file=sys.stderr)
    return res


def run_llama(a, fx):
    import llama_cpp
    # llama-cpp-python 0.3.36's AMX path dies on SIGILL on this VM: its ordinary CPU kernels
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_llamacpp import disable_extra_bufts
    disable_extra_bufts()
    V = fx["n_vocab"]
    n_max = max(len(p["ids"]) + fx["n_gen"] for p in fx["prompts"])
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=max(512, n_max + 16), n_batch=1024,
                          n_ubatch=1024, n_threads=a.threads, logits_all=True, verbose=False)
    res = []
    for p in fx["prompts"]:
        seq = p["ids"] + p["greedy"][:-1]
        llm.reset()
        llm.eval(seq)
        rows = np.array(llm.scores[: len(seq)], dtype=np.float32)
        assert rows.shape == (len(seq), V)
        steps = rows[len(p["ids"]) - 1:]
        res.append((steps[0], steps.argmax(axis=1)))
    del llm
    return res


def summarize(fx, R, res):
    per, rel, kl = [], [], []
    agree = n = agree_sure = n_sure = 0
    for p, (last, argmax) in zip(fx["prompts"], res):
        lf = lib.last_position_figures(p, R, last)
        tf = lib.teacher_forced_figures(p, argmax)
        rel.append(lf["rel_l2"]), kl.append(lf["kl_top64"])
        agree, n = agree + tf["agree"], n + tf["n"]
        agree_sure, n_sure = agree_sure + tf["agree_sure"], n_sure + tf["n_sure"]
        per.append({"prompt": p["name"], "n_prompt": len(p["ids"]), **lf, **tf})
    return {"rel_l2_median": float(np.median(rel)), "rel_l2_max": float(np.max(rel)),
            "kl_top64_mean": float(np.mean(kl)), "kl_top64_max": float(np.max(kl)),
            "top1_agree": agree, "steps": n, "top1_agree_sure": agree_sure, "steps_sure": n_sure,
            "prompts_leaving_reference": sum(q["first_diff"] is not None for q in per),
            "per_prompt": per}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--model", help="default: models/<the fixture's model file>")
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--modes", default="quant,exact,llama")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args()
    fx = lib.load(a.fixture)
    a.model = a.model or os.path.join(REPO, "models", fx["model"])
    R = lib.rademacher(fx["sketch"]["k"], fx["n_vocab"], fx["sketch"]["seed"])
    assert lib.rademacher_sha256(R) == fx["sketch"]["R_sha256"]
    out = {"fixture": os.path.basename(a.fixture), "model": os.path.basename(a.model),
           "threads": a.threads}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.modes.split(","):
            print(f"{mode}:", file=sys.stderr)
            t0 = time.time()
            if mode == "quant":
                res = run_chunkserve(a, fx, ["--threads", str(a.threads)], tmp)
            elif mode == "exact":
                res = run_chunkserve(a, fx, ["--threads", str(a.threads), "--exact"], tmp)
            elif mode == "llama":
                res = run_llama(a, fx)
            else:
                raise SystemExit(f"unknown mode {mode}")
            out[mode] = summarize(fx, R, res)
            out[mode]["seconds"] = round(time.time() - t0, 1)

    modes = [m for m in a.modes.split(",")]
    print(f"\n{fx['model']} vs transformers fp32 ({len(fx['prompts'])} prompts, "
          f"{fx['n_gen']} greedy steps each)")
    print(f"{'':28s}" + "".join(f"{m:>22s}" for m in modes))
    rows = [("rel L2 last pos, median", "rel_l2_median", "{:.3g}"),
            ("rel L2 last pos, max", "rel_l2_max", "{:.3g}"),
            ("KL top-64 last pos, mean", "kl_top64_mean", "{:.2e}"),
            ("KL top-64 last pos, max", "kl_top64_max", "{:.2e}")]
    for label, k, f in rows:
        print(f"{label:28s}" + "".join(f"{f.format(out[m][k]):>22s}" for m in modes))
    print(f"{'top-1 agree (all steps)':28s}" + "".join(
        f"{out[m]['top1_agree']:>16d}/{out[m]['steps']:<5d}" for m in modes))
    print(f"{'top-1 agree (margin>=0.01)':28s}" + "".join(
        f"{out[m]['top1_agree_sure']:>16d}/{out[m]['steps_sure']:<5d}" for m in modes))
    print("greedy leaves the reference at step (reference margin there):")
    for i, p in enumerate(fx["prompts"]):
        cells = []
        for m in modes:
            q = out[m]["per_prompt"][i]
            cells.append("-" if q["first_diff"] is None else
                         f"{q['first_diff']} ({q['first_diff_margin']:.3g})")
        print(f"  {p['name']:26s}" + "".join(f"{c:>22s}" for c in cells))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
