#!/usr/bin/env python3
"""Issue 19's mixed workload against `chunkserve serve`, one configuration after another on the
same machine: chat streams decoding while long prompts arrive, measured by two
`chunkserve bench serve` clients at once (independent of the server).

  chat   --streams closed-loop streams, each request a --chat-prompt-token prompt answered with
         --chat-tokens tokens, back to back for --duration seconds;
  long   --long prompts of --long-tokens tokens at a fixed rate over the same window
         (16 tokens answered each).

For each configuration (--configs: `unlimited`, a token budget `512`, a step-time target
`step300`, or `step300/512` for a target under a budget) it reports the chat streams' ITL
p50/p99/max, generated tokens/s of both clients together, and the long prompts' TTFT
mean/max; and from the server's step trace (CHUNKSERVE_STEP_TRACE) where the long prompts'
time went: steps with a chunk, their mean time and composition, time between steps.

    python3 bench/bench_step_target.py [--duration 90] [--configs unlimited,512,128,step300]

Writes --out (JSON). Numbers only mean something side by side in one run.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_server(bin_dir, model, cfg, kv_mib, threads, trace):
    args = [str(bin_dir / "chunkserve"), "serve", "--model", str(model), "--port", "0",
            "--http-port", "0", "--kv-cache-mib", str(kv_mib), "--max-queue", "4096"]
    if threads:
        args += ["--threads", str(threads)]
    budget, target = "0", None
    if cfg.startswith("step"):
        target, _, b = cfg[4:].partition("/")
        budget = b or "0"
    elif cfg != "unlimited":
        budget = cfg
    args += ["--max-batched-tokens", budget]
    if target:
        args += ["--step-time-target-ms", target]
    env = dict(os.environ, CHUNKSERVE_STEP_TRACE=str(trace))
    log = open(str(trace) + ".log", "w")
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    line = p.stdout.readline()
    if not line.startswith("listening on "):
        p.kill()
        sys.exit(f"server did not start: {line!r} (log {trace}.log)")
    return p, line.split()[-1]


def bench(bin_dir, target, dataset, out, *args):
    return subprocess.Popen([str(bin_dir / "chunkserve"), "bench", "serve", "--target", target,
                             "--workload", str(dataset), "--out", str(out), "--quiet",
                             "--slo-ttft-p99-ms", "0", "--slo-itl-p99-ms", "0", *map(str, args)])


def trace_summary(path, windows):
    """Steps inside the long prompts' (send, first token) windows."""
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            rows.append({k: float(v) for k, v in r.items()})
    inside = [r for r in rows if any(a <= r["start_s"] < b for a, b in windows)]
    chunk = [r for r in inside if r["prefill_spans"] > 0]
    total = sum(b - a for a, b in windows)
    return {
        "steps": len(rows),
        "long_window_s": total,
        "steps_in_window": len(inside),
        "chunk_steps_in_window": len(chunk),
        "step_s_in_window": sum(r["seconds"] for r in inside),
        "chunk_step_s_in_window": sum(r["seconds"] for r in chunk),
        "gap_s_in_window": sum(r["gap_s"] for r in inside),
        "mean_chunk_step_s": (sum(r["seconds"] for r in chunk) / len(chunk)) if chunk else None,
        "mean_chunk_step_tokens": (sum(r["tokens"] for r in chunk) / len(chunk)) if chunk else None,
        "mean_decode_rows_in_chunk_steps":
            (sum(r["decode_spans"] for r in chunk) / len(chunk)) if chunk else None,
        "predicted_vs_measured": [
            (r["predicted_s"], r["seconds"]) for r in chunk if r["predicted_s"] >= 0][:200],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=str(ROOT / "build" / "bin"))
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--configs", default="unlimited,512,128,step300")
    ap.add_argument("--duration", type=float, default=90)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--chat-prompt-tokens", type=int, default=32)
    ap.add_argument("--chat-tokens", type=int, default=48)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--kv-cache-mib", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "step_target.json"))
    a = ap.parse_args()
    bin_dir = Path(a.bin)
    tmp = Path(tempfile.mkdtemp(prefix="cs-step-target-"))
    chat_ds, long_ds = tmp / "chat.jsonl", tmp / "long.jsonl"
    chat_ds.write_text(json.dumps({"prompt_tokens": a.chat_prompt_tokens,
                                   "output_tokens": a.chat_tokens}) + "\n")
    long_ds.write_text(json.dumps({"prompt_tokens": a.long_tokens, "output_tokens": 16}) + "\n")
    results = []
    for cfg in a.configs.split(","):
        trace = tmp / f"trace-{cfg.replace('/', '_')}.csv"
        srv, addr = start_server(bin_dir, a.model, cfg, a.kv_cache_mib, a.threads, trace)
        t0 = time.monotonic()
        chat = bench(bin_dir, addr, chat_ds, tmp / "chat.json", "--arrival", "closed",
                     "--concurrency", a.streams, "--requests", 1000000, "--duration", a.duration,
                     "--seed", a.seed, "--warmup", 1)
        long = bench(bin_dir, addr, long_ds, tmp / "long.json", "--arrival", "fixed", "--rates",
                     a.long / a.duration, "--requests", a.long, "--seed", a.seed + 1,
                     "--save-requests", "--warmup", 0)
        rc = chat.wait(), long.wait()
        wall = time.monotonic() - t0
        srv.terminate()
        srv.wait(timeout=60)
        if rc != (0, 0):
            sys.exit(f"{cfg}: bench serve failed {rc}")
        c = json.load(open(tmp / "chat.json"))["points"][0]
        lj = json.load(open(tmp / "long.json"))
        lp = lj["points"][0]
        # the long prompts' (sent, first token) windows on the server's clock: the step
        # trace and bench serve both use CLOCK_MONOTONIC
        t_long = lp["start_monotonic_s"]
        windows = [(t_long + q["sent_s"], t_long + q["sent_s"] + q["ttft_ms"] / 1e3)
                   for q in lp["per_request"] if q["status"] == "OK"]
        out_tok = c["output_tokens"] + lp["output_tokens"]
        res = {
            "config": cfg,
            "chat_itl_ms": c["itl_ms"],
            "chat_completed": c["completed"],
            "generated_tok_s": out_tok / wall,
            "long_ttft_ms": lp["ttft_ms"],
            "long_completed": lp["completed"],
            "trace": str(trace),
            "long_prefill": trace_summary(trace, windows),
        }
        results.append(res)
        print(f"{cfg:>14}: chat ITL p50 {c['itl_ms']['p50']:7.1f} p99 {c['itl_ms']['p99']:7.1f} "
              f"max {c['itl_ms']['max']:7.1f} ms | generated {res['generated_tok_s']:6.1f} tok/s "
              f"| long TTFT mean {lp['ttft_ms']['mean']/1e3:5.2f} max {lp['ttft_ms']['max']/1e3:5.2f} s",
              flush=True)
        t = res["long_prefill"]
        if t["chunk_steps_in_window"]:
            print(f"{'':>14}  while long prompts prefilled ({t['long_window_s']:.1f} s): "
                  f"{t['chunk_steps_in_window']} chunk steps, mean {t['mean_chunk_step_s']*1e3:.0f} ms, "
                  f"{t['mean_chunk_step_tokens']:.0f} tokens ({t['mean_decode_rows_in_chunk_steps']:.1f} "
                  f"decode rows); all steps {t['step_s_in_window']:.1f} s, between steps "
                  f"{t['gap_s_in_window']:.2f} s", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    json.dump({"args": vars(a), "results": results}, open(a.out, "w"), indent=1)
    print(f"wrote {a.out}; step traces in {tmp}")


if __name__ == "__main__":
    main()
