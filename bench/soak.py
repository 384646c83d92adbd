#!/usr/bin/env python3
"""Soak: the cluster under steady load for a long window, with chaos every few
minutes (issue 18's soak; not in CI).

Processes (real model, one thread each, on loopback): the router, one prefill
worker, decode workers A and B. Prompts: --prompts random token-id prompts of
--min..--max tokens (seeded), each answered greedily with --max-tokens tokens
(ignore_eos); the expected ids come from a one-process `chunkserve serve` on
the same model before the cluster starts.

1. Capacity: --clients closed-loop clients for --calib seconds: requests/s.
2. Soak: Poisson arrivals at --load (default 0.8) x that rate for --duration
   seconds. A client retries UNAVAILABLE up to 3 times (as clients behind a
   Service do); every completed stream must equal the reference exactly (a
   lost or duplicated token fails it).
3. Chaos every --chaos-every seconds, in turn: kill -9 decode worker A and
   restart it 5 s later (same port); SIGSTOP decode worker B for 3 s; SIGSTOP
   the prefill worker for 3 s. The router, the prefill worker and B are never
   restarted, so their memory and descriptors can be followed for the whole
   window.
Every --sample seconds: each process's RSS and open descriptors, and the
window's ITL (gaps between token messages of one stream) p50/p99/max and
completions. At the end: RSS drift of the never-restarted processes (mean of
the last fifth of the window against the fifth after the first 5 minutes),
descriptor counts first/last, ITL p99 per fifth, tokens lost or duplicated,
requests failed after retries, and at idle every worker's pages free.
Writes --out (JSON) and, when matplotlib is importable, --plot (PNG).
Usage: bench/soak.py [--duration 1800] [--chaos-every 180]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "py"))
sys.path.insert(0, str(ROOT / "bench"))

import grpc  # noqa: E402

from bench_router_lag import protos  # noqa: E402
from cluster_harness import Proc, metric  # noqa: E402


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def n_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


class Load:
    """Requests and what they saw, shared by the client threads."""

    def __init__(self, g, stub, prompts, want, max_tokens):
        self.g, self.stub, self.prompts, self.want, self.max_tokens = g, stub, prompts, want, max_tokens
        self.lock = threading.Lock()
        self.gaps = []  # (time, gap) between token messages of one stream
        self.done = []  # (time, outcome): ok, mismatch, failed:<code>
        self.retries = 0

    def one(self, k):
        ids = self.prompts[k]
        for attempt in range(4):
            got, last, gaps = [], None, []
            try:
                for m in self.stub.Generate(self.g.GenerateRequest(
                        token_ids=self.g.TokenIds(ids=ids), sampling=self.g.SamplingParams(
                            max_tokens=self.max_tokens, ignore_eos=True)), timeout=120):
                    now = time.monotonic()
                    if m.token_ids:
                        if last is not None:
                            gaps.append((now, now - last))
                        last = now
                        got += list(m.token_ids)
                outcome = "ok" if got == self.want[k] else "mismatch"
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and attempt < 3 and not got:
                    with self.lock:
                        self.retries += 1
                    time.sleep(0.2)
                    continue
                outcome = f"failed:{e.code().name}"
            with self.lock:
                self.gaps += gaps
                self.done.append((time.monotonic(), outcome))
            return outcome


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "build" / "bin"))
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--duration", type=float, default=1800)
    ap.add_argument("--chaos-every", type=float, default=180)
    ap.add_argument("--calib", type=float, default=60)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--min", type=int, default=40)
    ap.add_argument("--max", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--sample", type=float, default=10)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="/tmp/soak.json")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "soak.png"))
    a = ap.parse_args()
    rng = random.Random(a.seed)
    g, gg = protos(Path("/tmp/soak-stubs"))
    bin_dir = Path(a.bin)
    prompts = [[rng.randrange(1, 49000) for _ in range(rng.randint(a.min, a.max))]
               for _ in range(a.prompts)]

    ref = Proc(bin_dir / "chunkserve", ["serve", f"--model={a.model}", "--port=0", "--http-port=0",
                                        "--threads=2"], "reference")
    try:
        rstub = gg.GenerationStub(grpc.insecure_channel(ref.addr))
        want = [[t for m in rstub.Generate(g.GenerateRequest(
            token_ids=g.TokenIds(ids=p), sampling=g.SamplingParams(
                max_tokens=a.max_tokens, ignore_eos=True)), timeout=300) for t in m.token_ids]
            for p in prompts]
    finally:
        ref.stop()

    common = [f"--model={a.model}", "--port=0", "--threads=1", "--kv-cache-mib=256"]
    dec_a = Proc(bin_dir / "chunkserve-decode", common, "decode-a")
    dec_b = Proc(bin_dir / "chunkserve-decode", common, "decode-b")
    pre = Proc(bin_dir / "chunkserve-prefill", common, "prefill")
    router = Proc(bin_dir / "chunkserve-router", [
        f"--model={a.model}", "--port=0", "--status-interval-ms=500", f"--prefill-workers={pre.addr}",
        f"--decode-workers={dec_a.addr},{dec_b.addr}"], "router")
    procs = {"router": router, "prefill": pre, "decode-a": dec_a, "decode-b": dec_b}
    try:
        t_end = time.monotonic() + 60
        while metric(router.metrics(), "chunkserve:workers_usable", 'role="decode"') < 2:
            assert time.monotonic() < t_end, "the decode workers never became usable"
            time.sleep(0.2)
        stub = gg.GenerationStub(grpc.insecure_channel(router.addr))

        # 1. capacity, closed loop
        cal = Load(g, stub, prompts, want, a.max_tokens)
        stop = threading.Event()

        def closed(i):
            k = i
            while not stop.is_set():
                cal.one(k % len(prompts))
                k += a.clients
        ts = [threading.Thread(target=closed, args=(i,)) for i in range(a.clients)]
        t0 = time.monotonic()
        for t in ts:
            t.start()
        time.sleep(a.calib)
        stop.set()
        for t in ts:
            t.join(300)
        cap_rps = len(cal.done) / (time.monotonic() - t0)
        rate = a.load * cap_rps
        print(f"capacity: {cap_rps:.2f} requests/s with {a.clients} closed-loop clients "
              f"({len(cal.done)} requests, {sum(o != 'ok' for _, o in cal.done)} not ok); "
              f"soak at {rate:.2f}/s", flush=True)

        # 2. the soak, open loop; 3. chaos; samples
        load = Load(g, stub, prompts, want, a.max_tokens)
        samples, events, threads = [], [], []
        t_start = time.monotonic()
        t_stop = t_start + a.duration
        pids = {}

        def sample():
            now = time.monotonic()
            row = {"t": now - t_start}
            for name, p in procs.items():
                try:
                    row[f"{name}.rss_kib"] = rss_kib(p.proc.pid)
                    row[f"{name}.fds"] = n_fds(p.proc.pid)
                except (FileNotFoundError, ProcessLookupError):
                    pass
                pids.setdefault(name, set()).add(p.proc.pid)
            with load.lock:
                gaps = [x for t, x in load.gaps if t > now - a.sample]
                done = [o for t, o in load.done if t > now - a.sample]
            row.update(itl_p50=pct(gaps, 0.5), itl_p99=pct(gaps, 0.99),
                       itl_max=max(gaps, default=float("nan")), completed=done.count("ok"),
                       bad=len(done) - done.count("ok"))
            samples.append(row)

        def chaos(i):
            kind = i % 3
            if kind == 0:
                dec_a.kill9()
                events.append((time.monotonic() - t_start, "kill -9 decode-a"))
                time.sleep(5)
                dec_a.start(port=dec_a.port)
            elif kind == 1:
                events.append((time.monotonic() - t_start, "SIGSTOP decode-b 3 s"))
                dec_b.pause()
                time.sleep(3)
                dec_b.resume()
            else:
                events.append((time.monotonic() - t_start, "SIGSTOP prefill 3 s"))
                pre.pause()
                time.sleep(3)
                pre.resume()

        next_arrival, next_sample = t_start, t_start
        next_chaos, n_chaos = t_start + a.chaos_every, 0
        k = 0
        while time.monotonic() < t_stop:
            now = time.monotonic()
            if now >= next_arrival:
                th = threading.Thread(target=load.one, args=(k % len(prompts),), daemon=True)
                th.start()
                threads.append(th)
                k += 1
                next_arrival += rng.expovariate(rate)
            if now >= next_sample:
                sample()
                next_sample += a.sample
            if now >= next_chaos:
                threading.Thread(target=chaos, args=(n_chaos,), daemon=True).start()
                n_chaos += 1
                next_chaos += a.chaos_every
            threads = [t for t in threads if t.is_alive()]
            time.sleep(max(0.0, min(next_arrival, next_sample, next_chaos) - time.monotonic()))
        for t in threads:
            t.join(300)
        sample()

        # at idle: every page free on every worker
        time.sleep(3)
        idle = {}
        for name in ("prefill", "decode-a", "decode-b"):
            m = procs[name].metrics()
            idle[name] = (metric(m, "chunkserve:kv_pages_free"), metric(m, "chunkserve:kv_pages_total"))

        outcomes = {}
        for _, o in load.done:
            outcomes[o] = outcomes.get(o, 0) + 1
        fifth = a.duration / 5
        early = [s for s in samples if 300 <= s["t"] < 300 + fifth] or samples[:max(1, len(samples) // 5)]
        late = [s for s in samples if s["t"] >= a.duration - fifth]
        drift = {}
        for name in ("router", "prefill", "decode-b"):
            key = f"{name}.rss_kib"
            e = statistics.mean(s[key] for s in early if key in s)
            lt = statistics.mean(s[key] for s in late if key in s)
            drift[name] = dict(early_mib=e / 1024, late_mib=lt / 1024, drift=(lt - e) / e)
        fds = {name: (samples[0].get(f"{name}.fds"), samples[-1].get(f"{name}.fds"))
               for name in procs}
        p99_by_fifth = []
        for i in range(5):
            gaps = [x for t, x in load.gaps if t_start + i * fifth <= t < t_start + (i + 1) * fifth]
            p99_by_fifth.append(dict(p50=pct(gaps, 0.5), p99=pct(gaps, 0.99),
                                     max=max(gaps, default=float("nan")), n=len(gaps)))
        result = dict(args=vars(a), capacity_rps=cap_rps, rate=rate, outcomes=outcomes,
                      retries=load.retries, drift=drift, fds=fds, itl_by_fifth=p99_by_fifth,
                      idle_pages=idle, events=events, samples=samples,
                      restarts={n: len(p) - 1 for n, p in pids.items()})
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(f"requests: {outcomes}, {load.retries} retries on UNAVAILABLE, chaos: "
              f"{len(events)} events")
        for name, d in drift.items():
            print(f"  {name}: RSS {d['early_mib']:.1f} -> {d['late_mib']:.1f} MiB "
                  f"({100 * d['drift']:+.2f}%)")
        print(f"  fds first/last: {fds}")
        print("  ITL per fifth (ms, p50/p99/max): " + ", ".join(
            f"{1e3 * f['p50']:.0f}/{1e3 * f['p99']:.0f}/{1e3 * f['max']:.0f}" for f in p99_by_fifth))
        print(f"  at idle, pages free/total: {idle}")
        try:
            plot(a, result)
        except ImportError:
            print("(no matplotlib: no plot)")
    finally:
        for p in procs.values():
            if p.paused:
                p.resume()
            p.stop()


def plot(a, r):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = r["samples"]
    t = [x["t"] / 60 for x in s]
    fig, ax = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for name in ("router", "prefill", "decode-a", "decode-b"):
        ax[0].plot(t, [x.get(f"{name}.rss_kib", float("nan")) / 1024 for x in s], label=name)
        ax[1].plot(t, [x.get(f"{name}.fds", float("nan")) for x in s], label=name)
    ax[0].set_ylabel("RSS MiB")
    ax[1].set_ylabel("open fds")
    ax[2].plot(t, [1e3 * x["itl_p50"] for x in s], label="ITL p50")
    ax[2].plot(t, [1e3 * x["itl_p99"] for x in s], label="ITL p99")
    ax[2].set_ylabel(f"ms (per {a.sample:.0f} s)")
    ax[2].set_xlabel("minutes")
    for at, what in r["events"]:
        for x in ax:
            x.axvline(at / 60, color="grey", lw=0.5, ls=":")
    for x in ax:
        x.legend(fontsize=7, loc="upper left")
    ax[0].set_title(f"soak: {r['rate']:.2f} req/s ({100 * a.load:.0f}% of capacity), chaos every "
                    f"{a.chaos_every:.0f} s (dotted)")
    fig.tight_layout()
    Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.plot, dpi=90)
    print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
