#!/usr/bin/env python3
"""Single-sequence prefill and decode speed: chunkserve's engine (quantized
kernels, the same with bf16 KV, the same without AMX tiles, and --exact fp32) next to llama.cpp
(llama-cpp-python) on the same GGUF file, same prompt, same thread count, in
one run. Prints a table and the ratios; numbers are never
asserted anywhere (machines are shared and noisy: compare the ratio).

    python3 bench/bench_single.py --bin build/bin/chunkserve \
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 1

llama.cpp's side needs `pip install llama-cpp-python` (not a CI dependency);
without it only chunkserve's figures are printed.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

sys.path.insert(0, HERE)
from bench_llamacpp import PROMPT_TEXT  # noqa: E402  (the same text on both sides)


def make_prompt_ids(bin_path, model, n_tokens):
    """Exactly n_tokens ids: the shared text, repeated, tokenized by chunkserve
    (whose tokenizer is checked id-for-id against llama.cpp's in the tests)."""
    text = PROMPT_TEXT * (n_tokens // 50 + 1)
    p = subprocess.run([bin_path, "tokenize", "--model", model], input=json.dumps(text) + "\n",
                       capture_output=True, text=True, check=True)
    return json.loads(p.stdout)[:n_tokens]


def run_chunkserve(bin_path, model, ids, decode_tokens, extra, kernels=None):
    cmd = [bin_path, "generate", "--model", model, "--ids", ",".join(map(str, ids)),
           "--max-tokens", str(decode_tokens), "--ignore-eos", *extra]
    env = dict(os.environ)
    if kernels:
        env["CHUNKSERVE_CPU_KERNELS"] = kernels
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if p.returncode != 0:
        sys.exit(f"chunkserve failed: {p.stderr}")
    m = re.search(r"prompt (\d+) tokens in ([\d.]+) s .*generated (\d+) tokens in ([\d.]+) s", p.stderr)
    if not m:
        sys.exit(f"could not parse chunkserve's timing line:\n{p.stderr}")
    n_prompt, t_prompt, n_gen, t_gen = int(m[1]), float(m[2]), int(m[3]), float(m[4])
    return {"prompt_tokens": n_prompt, "prefill_tok_s": n_prompt / t_prompt,
            "decode_tok_s": (n_gen - 1) / t_gen if n_gen > 1 else 0.0}


def run_llamacpp(model, prompt_tokens, decode_tokens, threads, extra=()):
    cmd = [sys.executable, os.path.join(HERE, "bench_llamacpp.py"), "--model", model,
           "--prompt-tokens", str(prompt_tokens), "--decode-tokens", str(decode_tokens),
           "--threads", str(threads), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        why = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"
        print(f"llama.cpp {' '.join(extra) or '(default)'} failed: {why}")
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/bin/chunkserve")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="threads for llama.cpp and chunkserve's engine")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds; every engine runs once a round, in turn, and medians are reported")
    ap.add_argument("--no-exact", action="store_true", help="skip the --exact fp32 row (slow on big models)")
    ap.add_argument("--baseline-bin", help="another chunkserve (e.g. the last commit's build): its "
                    "quantized row runs in the same rounds, for a before/after ratio")
    a = ap.parse_args()
    ids = make_prompt_ids(a.bin, a.model, a.prompt_tokens)
    common = ["--threads", str(a.threads), "--max-batched-tokens", "0"]
    variants = [(f"chunkserve, {a.threads} thr (quant)", common, None),
                (f"chunkserve, {a.threads} thr (quant, bf16 KV)", common + ["--kv-bf16"], None),
                (f"chunkserve, {a.threads} thr (quant, no AMX)", common, "vnni")]
    if not a.no_exact:
        variants.append((f"chunkserve, {a.threads} thr (--exact fp32)", common + ["--exact"], None))
    if a.baseline_bin:
        variants.insert(1, (f"baseline {a.baseline_bin}, {a.threads} thr (quant)", common, None,
                            a.baseline_bin))
    runs = {v[0]: [] for v in variants}
    refs, ref_name, ref_extra = [], "same file", []
    for _ in range(a.repeat):
        for name, flags, kernels, *other in variants:
            runs[name].append(run_chunkserve(other[0] if other else a.bin, a.model, ids,
                                             a.decode_tokens, flags, kernels))
        ref = run_llamacpp(a.model, a.prompt_tokens, a.decode_tokens, a.threads, ref_extra)
        if ref is None and not ref_extra:  # 0.3.36's AMX buffers crash on Sapphire Rapids VMs
            ref_extra, ref_name = ["--no-extra-bufts"], "same file, no extra bufts"
            ref = run_llamacpp(a.model, a.prompt_tokens, a.decode_tokens, a.threads, ref_extra)
        if ref:
            refs.append(ref)

    def med(rs, key):
        return statistics.median(r[key] for r in rs)

    print(f"{a.model}: {a.prompt_tokens}-token prompt, {a.decode_tokens} decoded, {a.threads} threads, "
          f"medians of {a.repeat} alternated round{'s' if a.repeat > 1 else ''}")
    print(f"{'engine':<44} {'prompt tok':>10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, rs in runs.items():
        print(f"{name:<44} {rs[0]['prompt_tokens']:>10} {med(rs, 'prefill_tok_s'):>14.1f} "
              f"{med(rs, 'decode_tok_s'):>13.1f}")
    if refs:
        rp, rd = med(refs, "prefill_tok_s"), med(refs, "decode_tok_s")
        print(f"{'llama.cpp, ' + str(a.threads) + ' thr (' + ref_name + ')':<44} {a.prompt_tokens:>10} "
              f"{rp:>14.1f} {rd:>13.1f}")
        for name, rs in runs.items():
            print(f"ratio {name} / llama.cpp: prefill {med(rs, 'prefill_tok_s') / rp:.3f}, "
                  f"decode {med(rs, 'decode_tok_s') / rd:.3f}")


if __name__ == "__main__":
    main()
