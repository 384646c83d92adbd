#!/usr/bin/env python3
"""Two tenants on one `chunkserve serve` (issue 41's measure): tenant A keeps --streams chat
streams going (short prompts, --answer-tokens each, closed loop) while tenant B floods the
server with --flood prompts of --flood-tokens tokens, at once or one every --flood-every seconds
(far beyond what it can prefill in the window). Three runs side by side on one machine, the step-time target T the same:
  alone   A only: its TTFT and ITL without B;
  fair    A and B, each naming its tenant (X-Chunkserve-Tenant): token-fair steps;
  fcfs    A and B with no tenant (one tenant: arrival order, as before tenants).
Reported per run: A's TTFT and ITL p50/p99/max, A's answers completed, B's prompt tokens
computed per second in the window (the engine's prompt_tokens_total less A's prompts), and the
TTFT predictor's error over the window's first tokens (chunkserve:ttft_prediction_error_ratio:
the median and the shares within 10/20/50%; goal: median <= 20%).
Goals (issue 41): fair A p99 TTFT <= alone p99 + 2T; fair A p99 ITL <= 1.2T; fair B rate >= 90%
of what A leaves (read against fcfs, where B takes all A waits for).
A's answers are streamed with special tokens as text (skip_special_tokens false), so every token
is an event and a gap between events is one token's: with them skipped, a template token gives an
empty event and the next gap spans two tokens (two steps under the target).
--cluster: the same on a 1+1 cluster (a router, one prefill and one decode worker, one engine
thread each, both with the step-time target): A's short prompts prefill on the decode worker,
B's long ones on the prefill worker; B's rate is the prefill worker's, the predictor error the
router's.

    python3 bench/bench_tenants.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--cluster]
        [--streams 4] [--flood 40] [--flood-tokens 3000] [--window 30] [--target-ms 200]
"""
import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from bench_priority import metric, start  # the same server and /metrics reader

ROOT = Path(__file__).resolve().parents[1]


def post(http, body, tenant):
    headers = {"Content-Type": "application/json"}
    if tenant:
        headers["X-Chunkserve-Tenant"] = tenant
    req = urllib.request.Request(f"http://{http}/v1/completions", data=json.dumps(body).encode(),
                                 headers=headers)
    return urllib.request.urlopen(req, timeout=3600)


def buckets(ops, name):
    """A histogram's cumulative bucket counts {le: count} from /metrics."""
    out = {}
    with urllib.request.urlopen(f"http://{ops}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + '_bucket{le="'):
                le = line.split('"')[1]
                out[float("inf") if le == "+Inf" else float(le)] = float(line.split()[1])
    return out


def error_summary(b0, b1):
    """The TTFT predictor's |predicted - measured| / measured over the window: the share of
    requests within 10/20/50% and the median (linear within its bucket)."""
    d = {le: b1.get(le, 0) - b0.get(le, 0) for le in sorted(b1)}
    n = d.get(float("inf"), 0)
    if not n:
        return "no predictions"
    median, prev_le, prev_c = float("nan"), 0.0, 0.0
    for le, c in d.items():
        if c >= n / 2:
            median = prev_le + (le - prev_le) * (n / 2 - prev_c) / max(c - prev_c, 1e-9)
            break
        prev_le, prev_c = le, c
    share = lambda x: f"{100 * d.get(x, 0) / n:.0f}%"  # noqa: E731
    return (f"predictor error over {n:.0f} requests: median {100 * median:.0f}%, within "
            f"10% {share(0.1)}, 20% {share(0.2)}, 50% {share(0.5)}")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Serve:
    """One `chunkserve serve`: the OpenAI door, B's prompt tokens (the engine's less A's), the
    predictor's error histogram."""

    def __init__(self, args):
        self.p, self.ops, self.http = start(Path(args.bin_dir), args.model, args.target_ms,
                                            args.threads)
        self.procs = [self.p]

    def prompt_tokens(self, a_prompt):
        return metric(self.ops, "chunkserve:prompt_tokens_total") - a_prompt

    def error_buckets(self):
        return buckets(self.ops, "chunkserve:ttft_prediction_error_ratio")


class Cluster:
    """A router, one decode and one prefill worker (one engine thread each): B's prompt tokens
    are the prefill worker's (A's prompts prefill on the decode worker), the error the router's."""

    def __init__(self, args):
        b = Path(args.bin_dir)
        engine = ["--model", args.model, "--port", "0", "--http-port", "0", "--threads", "1",
                  "--step-time-target-ms", str(args.target_ms), "--max-queue", "4096",
                  "--kv-cache-mib", "2048"]
        self.procs = []
        try:
            self._start_all(args, b, engine)
        except BaseException:
            for p in self.procs:
                p.kill()
            raise

    def _start_all(self, args, b, engine):
        dec, _ = self._start([b / "chunkserve-decode", *engine], 2)
        pre, self.ops = self._start([b / "chunkserve-prefill", *engine, "--decode-workers", dec], 2)
        _, self.router_ops, self.http = self._start([
            b / "chunkserve-router", "--model", args.model, "--port", "0", "--http-port", "0",
            "--openai-port", "0", "--max-queue", "4096", "--decode-workers", dec,
            "--prefill-workers", pre], 3)
        t_end = time.monotonic() + 60
        while not all(metric(self.router_ops, f'chunkserve:workers_usable{{role="{r}"}}') == 1
                      for r in ("prefill", "decode")):
            if time.monotonic() > t_end:
                raise SystemExit("the router did not reach both workers in 60 s")
            time.sleep(0.2)

    def _start(self, cmd, n_lines):
        p = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
        self.procs.append(p)
        return [p.stdout.readline().split()[-1] for _ in range(n_lines)]

    def prompt_tokens(self, a_prompt):
        return metric(self.ops, "chunkserve:prompt_tokens_total")

    def error_buckets(self):
        return buckets(self.router_ops, "chunkserve:ttft_prediction_error_ratio")


def run(args, mode):
    target = (Cluster if args.cluster else Serve)(args)
    http = target.http
    ta, tb = ("A", "B") if mode == "fair" else ("", "")
    stop = time.monotonic() + 10**9
    ttfts, itls, a_prompt = [], [], [0]
    lock = threading.Lock()
    try:
        with urllib.request.urlopen(f"http://{http}/v1/models", timeout=10) as r:
            name = json.loads(r.read())["data"][0]["id"]
        words = "the quick brown fox jumps over the lazy dog and keeps running".split()
        long_prompt = " ".join(words[i % len(words)] for i in range(args.flood_tokens))

        def flood(i):
            try:
                post(http, {"model": name, "prompt": f"{i} {long_prompt}", "max_tokens": 4,
                            "temperature": 0}, tb).read()
            except OSError:
                pass  # stopped at the end of the window

        def stream(k):
            n = 0
            while time.monotonic() < stop:
                body = {"model": name, "prompt": f"chat {k}.{n}: tell me about the weather",
                        "max_tokens": args.answer_tokens, "temperature": 0, "ignore_eos": True,
                        "skip_special_tokens": False,  # one event a token (the docstring)
                        "stream": True, "stream_options": {"include_usage": True}}
                t0 = last = time.monotonic()
                first, gaps = None, []
                try:
                    with post(http, body, ta) as r:
                        for line in r:
                            if not line.startswith(b"data: {"):
                                continue
                            ev = json.loads(line[6:])
                            if ev.get("usage"):
                                with lock:
                                    a_prompt[0] += ev["usage"]["prompt_tokens"]
                            if ev.get("choices") and ev["choices"][0].get("text"):
                                now = time.monotonic()
                                if first is None:
                                    first = now - t0
                                else:
                                    gaps.append(now - last)
                                last = now
                except OSError:
                    return
                if first is not None and time.monotonic() < stop:
                    with lock:
                        ttfts.append(first)
                        itls.extend(gaps)
                n += 1

        if mode != "alone":
            def arrivals():
                for i in range(args.flood):
                    threading.Thread(target=flood, args=(i,), daemon=True).start()
                    if args.flood_every > 0:
                        time.sleep(args.flood_every)
            threading.Thread(target=arrivals, daemon=True).start()
            time.sleep(2)  # the flood queued (at once), or began
        p0, t0 = target.prompt_tokens(0), time.monotonic()
        e0 = target.error_buckets()
        stop = t0 + args.window
        streams = [threading.Thread(target=stream, args=(k,), daemon=True)
                   for k in range(args.streams)]
        for t in streams:
            t.start()
        time.sleep(args.window)
        with lock:
            a_tokens = a_prompt[0]
        rate_b = (target.prompt_tokens(a_tokens) - p0) / (time.monotonic() - t0)
        err = error_summary(e0, target.error_buckets())
        return ttfts, itls, rate_b, err
    finally:
        for p in target.procs:
            p.kill()
            p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--bin-dir", default=str(ROOT / "build" / "bin"))
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--flood", type=int, default=40)
    ap.add_argument("--flood-tokens", type=int, default=3000)
    ap.add_argument("--flood-every", type=float, default=0,
                    help="seconds between B's prompts (0: all at once)")
    ap.add_argument("--window", type=int, default=30)
    ap.add_argument("--target-ms", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2, help="serve's engine threads")
    ap.add_argument("--cluster", action="store_true", help="a 1+1 cluster instead of serve")
    args = ap.parse_args()
    for mode in ("alone", "fair", "fcfs"):
        t, i, rate_b, err = run(args, mode)
        ms = lambda x: f"{x * 1e3:.0f}"  # noqa: E731
        print(f"{mode:5}: A answers {len(t)}, TTFT p50/p99/max {ms(pct(t, .5))}/{ms(pct(t, .99))}/"
              f"{ms(max(t) if t else float('nan'))} ms, ITL p50/p99/max {ms(pct(i, .5))}/"
              f"{ms(pct(i, .99))}/{ms(max(i) if i else float('nan'))} ms; "
              f"B prompt tokens/s {rate_b:.0f}; {err}", flush=True)
    print(f"goals: fair A p99 TTFT <= alone p99 + 2T ({2 * args.target_ms} ms); "
          f"fair A p99 ITL <= 1.2T ({1.2 * args.target_ms:.0f} ms); fair B rate >= 90% of fcfs's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
