#!/usr/bin/env python3
"""Single-sequence prefill and decode throughput of llama.cpp (llama-cpp-python) on a GGUF model.

Prints one JSON line, e.g.
  {"engine": "llama.cpp", "prefill_tok_s": ..., "decode_tok_s": ..., ...}

Method: load the model once (CPU, --threads threads, context prompt+decode), then for each of
--repeats timed runs (after --warmup untimed runs):
  prefill: clear the KV cache, evaluate the N-token prompt in batches of --n-batch tokens
           (logits of the last position only), wall time -> N / t;
  decode:  M greedy steps, each evaluating the argmax token of the previous step (batch of
           one token, then argmax over its logits in numpy), wall time -> M / t.
The reported figures are the medians over repeats (min/max also given).  The prompt is real
English text tokenized by the model's own tokenizer, repeated/truncated to exactly N tokens,
so it is the same on every run and machine.

Needs `pip install llama-cpp-python` (not a project dependency; only the benchmarks use it).

Usage:
  python bench/bench_llamacpp.py [--model PATH] [--threads 2] [--prompt-tokens 512]
                                 [--decode-tokens 64] [--repeats 3] [--warmup 1] [--n-batch 512]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DEFAULT_MODEL = os.environ.get(
    "CHUNKSERVE_MODEL", os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))

PROMPT_TEXT = (
    "The history of computing is a story of abstraction layered upon abstraction. Early machines "
    "were programmed by physically rewiring circuits; later, stored-program computers let "
    "engineers write instructions as numbers in memory. Assembly languages gave those numbers "
    "mnemonic names, and compilers translated higher-level languages into machine code. Each "
    "step traded a little efficiency for a great deal of human productivity. Modern language "
    "models add yet another layer: they turn text into tokens, tokens into vectors, and vectors, "
    "after billions of multiply-accumulate operations, back into a probability distribution over "
    "the next token. Serving them well means measuring before optimizing.\n"
)


def disable_extra_bufts() -> None:
    """Later Llama() objects load without llama.cpp's extra weight buffers (AMX / repacked):
    llama-cpp-python 0.3.36's AMX path dies on SIGILL on a Sapphire Rapids VM. Llama() does
    not expose the flag, so this patches the defaults it starts from."""
    import llama_cpp.llama as llama_mod
    default_params = llama_mod.llama_cpp.llama_model_default_params

    def no_extra_bufts():
        params = default_params()
        params.use_extra_bufts = False
        return params
    llama_mod.llama_cpp.llama_model_default_params = no_extra_bufts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--n-batch", type=int, default=512, help="llama.cpp n_batch/n_ubatch for prefill")
    ap.add_argument("--no-extra-bufts", action="store_true",
                    help="llama.cpp's use_extra_bufts = false: no AMX / repacked weight buffers "
                         "(its AMX path segfaults on SmolLM2 Q4_1 in 0.3.36 on a Sapphire Rapids VM)")
    args = ap.parse_args()

    try:
        import llama_cpp
        import numpy as np
    except ImportError as e:
        print(f"bench_llamacpp: ERROR: llama-cpp-python is not installed ({e}).\n"
              f"  Install it with: CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install llama-cpp-python==0.3.36",
              file=sys.stderr)
        return 2
    if not os.path.isfile(args.model):
        print(f"bench_llamacpp: ERROR: model not found: {args.model} "
              f"(run scripts/fetch-model.sh or pass --model)", file=sys.stderr)
        return 2
    if args.prompt_tokens < 1 or args.decode_tokens < 1:
        print("bench_llamacpp: ERROR: --prompt-tokens and --decode-tokens must be >= 1", file=sys.stderr)
        return 2

    n_ctx = args.prompt_tokens + args.decode_tokens + 8
    n_batch = max(1, min(args.n_batch, args.prompt_tokens))
    t_load = time.perf_counter()
    if args.no_extra_bufts:
        disable_extra_bufts()
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                          n_threads=args.threads, n_threads_batch=args.threads,
                          logits_all=False, n_gpu_layers=0, verbose=False)
    t_load = time.perf_counter() - t_load

    base = list(llm.tokenize(PROMPT_TEXT.encode("utf-8"), add_bos=False, special=False))
    prompt = (base * (args.prompt_tokens // len(base) + 1))[: args.prompt_tokens]
    n_vocab = llm.n_vocab()

    def last_argmax() -> int:
        # logits_all=False: llama.cpp keeps logits of the batch's last token only; Llama.scores
        # is not filled in that mode, so read them from the context directly.
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    def one_run():
        llm.reset()                 # n_tokens = 0; eval() then drops every cached KV entry
        llm._ctx.kv_cache_clear()
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = last_argmax()
        t1 = time.perf_counter()
        for _ in range(args.decode_tokens):
            llm.eval([tok])
            tok = last_argmax()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    for _ in range(args.warmup):
        one_run()
    prefill_s, decode_s = [], []
    for _ in range(args.repeats):
        p, d = one_run()
        prefill_s.append(p)
        decode_s.append(d)

    pre_tps = [args.prompt_tokens / t for t in prefill_s]
    dec_tps = [args.decode_tokens / t for t in decode_s]
    result = {
        "engine": "llama.cpp",
        "llama_cpp_python": getattr(llama_cpp, "__version__", None),
        "model": os.path.basename(args.model),
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "n_batch": n_batch,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "prefill_tok_s": statistics.median(pre_tps),
        "prefill_tok_s_min": min(pre_tps),
        "prefill_tok_s_max": max(pre_tps),
        "decode_tok_s": statistics.median(dec_tps),
        "decode_tok_s_min": min(dec_tps),
        "decode_tok_s_max": max(dec_tps),
        "prefill_s_median": statistics.median(prefill_s),
        "decode_s_median": statistics.median(decode_s),
        "load_s": t_load,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
