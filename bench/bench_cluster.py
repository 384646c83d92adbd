#!/usr/bin/env python3
"""Cluster vs one process on the mixed workload (issue 7's measure).

Replays the workload of `chunkserve bench-local` (cli/bench_local.c) through the
public gRPC API (stubs generated from proto/ at run time), against each
configuration in turn, in one run:
  serve-512        chunkserve serve --max-batched-tokens 512       --threads T
  serve-unlimited  chunkserve serve --max-batched-tokens unlimited --threads T
  cluster          chunkserve cluster up --prefill 1 --decode 1
                   --prefill-threads T/2 --decode-threads T/2 (router + 2 workers)
Workload (the same seed-driven schedule for every configuration):
  --streams chat streams, each asking one short question after another
  (prompt of --chat-min..--chat-max random token ids, --chat-max-tokens
  answer tokens, ignore_eos; a seeded exponential think time of mean --think
  seconds before each question, so the streams do not fall into lockstep),
  and long prompts of --long-min..--long-max random token ids
  (--long-max-tokens answer tokens) arriving on a seeded
  Poisson schedule with mean gap --long-gap seconds. Random ids keep the prefix
  cache out of it; ignore_eos makes every answer exactly max_tokens long.
Measured per configuration, over --duration seconds of wall time:
  chat ITL p50/p99/max   client timestamps of each token within a chat answer.
                         A message carrying k tokens stamps all k with its
                         arrival time, i.e. gives k-1 zero gaps (same rule for
                         every configuration; the share of such tokens is
                         reported). Gaps across two answers are not ITL (the
                         second is a chat TTFT).
  long TTFT p50/p99      request sent -> first token, long prompts sent in the
                         window (after the window the chats keep running until
                         every long prompt has its first token, so the load
                         stays the same; only window tokens count elsewhere)
  output tok/s           tokens received in the window / window
  router overhead        chunkserve:router_overhead_seconds (receipt -> Decode
                         call issued) from the router's /metrics, before/after
  KV transfers           the workers' kv_transfer* metrics, before/after
  CPU                    of every server process and of this client, and
                         what other processes used (the machine is shared:
                         before each config it waits for the machine to be
                         idle, and reruns a config, at most --retries times,
                         when others used more than --max-others cores,
                         keeping the least disturbed attempt; the discarded
                         ones stay in the JSON)
Raw results: OUT/bench_cluster.json (plot: bench/plot_bench_cluster.py).
Usage: python3 bench/bench_cluster.py [--duration 60] [--seed 1] [--wait-load 1.0]
       python3 bench/bench_cluster.py --report bench/out/bench_cluster.json"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
CLK = os.sysconf("SC_CLK_TCK")


def stubs():
    out = tempfile.mkdtemp(prefix="chunkserve-bench-")
    inc = Path(protoc.__file__).parent / "_proto"
    for p in ("chunkserve/v1/generation.proto",):
        assert protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{inc}", f"--python_out={out}",
                            f"--grpc_python_out={out}", p]) == 0
    sys.path.insert(0, out)
    return (importlib.import_module("chunkserve.v1.generation_pb2"),
            importlib.import_module("chunkserve.v1.generation_pb2_grpc"))


def pct(xs, p):
    """Same rule as bench-local: sorted[round(p/100 * (n-1))]."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[int(p / 100.0 * (len(xs) - 1) + 0.5)]


# ---------------------------------------------------------------- /metrics --

def scrape(http):
    """{name: {labels: value}} of a Prometheus text page; {} if unreachable."""
    out = {}
    if not http:
        return out
    try:
        with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out.setdefault(m.group(1), {})[m.group(2) or ""] = float(m.group(3))
    return out


def counter(before, after, name):
    return sum(after.get(name, {}).values()) - sum(before.get(name, {}).values())


def hist(before, after, name):
    """Delta of a histogram: (buckets [(le, cumulative)], sum, count)."""
    def b(m):
        d = {}
        for lab, v in m.get(name + "_bucket", {}).items():
            le = re.search(r'le="([^"]+)"', lab).group(1)
            d[float("inf") if le == "+Inf" else float(le)] = v
        return d
    b0, b1 = b(before), b(after)
    buckets = sorted((le, b1[le] - b0.get(le, 0)) for le in b1)
    return buckets, counter(before, after, name + "_sum"), counter(before, after, name + "_count")


def hist_quantile(buckets, q):
    """Quantile from cumulative buckets, linearly interpolated inside the bucket
    (as Prometheus' histogram_quantile). Returns (value, note)."""
    if not buckets or buckets[-1][1] <= 0:
        return float("nan"), "no samples"
    total = buckets[-1][1]
    rank = q * total
    lo, prev = 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if le == float("inf"):
                return lo, f"> {lo:g} (in the +Inf bucket)"
            frac = (rank - prev) / (cum - prev) if cum > prev else 0.0
            return lo + (le - lo) * frac, f"in ({lo:g}, {le:g}]"
        lo, prev = le, cum
    return float("nan"), "?"


def hist_summary(before, after, name):
    buckets, s, n = hist(before, after, name)
    p50, n50 = hist_quantile(buckets, 0.5)
    p99, n99 = hist_quantile(buckets, 0.99)
    return {"count": n, "sum_s": s, "mean_s": s / n if n else float("nan"), "p50_s": p50, "p50_bucket": n50,
            "p99_s": p99, "p99_bucket": n99, "buckets": buckets}


# ------------------------------------------------------------ processes ----

def cpu_ticks(pid):
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])  # utime + stime, all threads
    except (OSError, IndexError, ValueError):
        return None


def machine_cpu():
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = f[3] + f[4]
    return sum(f[:8]) - idle, sum(f[:8]), f[7]  # busy, total, steal


def children(pid):
    out = []
    for t in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (t / "children").read_text().split()]
        except OSError:
            pass
    return out


class Server:
    """One configuration's processes: `chunkserve serve` or `chunkserve cluster up`."""

    def __init__(self, name, argv, log_path, start_timeout=300):
        self.name, self.argv = name, argv
        self.log = open(log_path, "w")
        env = dict(os.environ, OPENBLAS_CORETYPE=os.environ.get("OPENBLAS_CORETYPE", "SkylakeX"))
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                  start_new_session=True)
        self.addr, self.router_http, self.http, self.procs = None, None, {}, {}
        deadline = time.monotonic() + start_timeout
        self.banner = []
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"{name}: exited while starting (log: {log_path})")
            line = line.rstrip("\n")
            self.banner.append(line)
            m = re.match(r"^cluster up: router \S+ \(http (\S+)\)", line)
            if m:
                self.router_http = m.group(1)
            m = re.match(r"^\s+(prefill|decode)\s+\S+ \(http ([^,]+), pid (\d+)\)", line)
            if m:
                self.http[m.group(1)] = m.group(2)
                self.procs[m.group(1)] = int(m.group(3))
            if line.startswith("listening on "):
                self.addr = line.split()[-1]
                break
        if not self.addr:
            self.stop()
            raise RuntimeError(f"{name}: not listening after {start_timeout} s")
        # drain the rest of stdout so the process never blocks on it
        threading.Thread(target=lambda: [None for _ in self.p.stdout], daemon=True).start()
        if self.procs:  # the router is the cluster's remaining child
            kids = [k for k in children(self.p.pid) if k not in self.procs.values()]
            if kids:
                self.procs["router"] = kids[0]
        else:
            self.procs["serve"] = self.p.pid

    def cpu(self):
        return {k: cpu_ticks(v) for k, v in self.procs.items()}

    def alive(self):
        return {k: Path(f"/proc/{v}").exists() for k, v in self.procs.items()}

    def stop(self):
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGINT)  # serve and cluster up both drain on SIGINT
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self.log.close()
        return self.p.returncode


# ------------------------------------------------------------- workload ----

def schedule(a):
    """The long prompts: (offset s, token ids), the same for every config."""
    rng = random.Random(a.seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / a.long_gap)
        if t >= a.duration:
            return out
        n = rng.randrange(a.long_min, a.long_max + 1)
        out.append((t, [rng.randrange(100, 20000) for _ in range(n)]))


def chat_prompts(a, stream):
    """A stream's questions: (think seconds before it, token ids). The first
    wait staggers the streams' starts; exponential think times keep them from
    falling into lockstep (same-length answers would otherwise make every
    stream ask at the same step, one burst of prefills each time)."""
    rng = random.Random(a.seed * 7919 + 1 + stream)
    think = rng.uniform(0, 2 * a.think) if a.think else 0.0
    while True:
        yield think, [rng.randrange(100, 20000) for _ in range(rng.randrange(a.chat_min, a.chat_max + 1))]
        think = rng.expovariate(1.0 / a.think) if a.think else 0.0


class Call:
    __slots__ = ("kind", "stream", "n_prompt", "t_send", "msgs", "code", "detail", "finish")

    def __init__(self, kind, stream, n_prompt):
        self.kind, self.stream, self.n_prompt = kind, stream, n_prompt
        self.t_send, self.msgs, self.code, self.detail, self.finish = 0.0, [], "OK", "", 0


def generate(g, stub, ids, max_tokens, call, timeout):
    req = g.GenerateRequest(token_ids=g.TokenIds(ids=ids),
                            sampling=g.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    call.t_send = time.monotonic()
    try:
        for m in stub.Generate(req, timeout=timeout):
            now = time.monotonic()
            if m.token_ids:
                call.msgs.append((now, len(m.token_ids)))
            if m.finish_reason:
                call.finish = m.finish_reason
    except grpc.RpcError as e:
        call.code, call.detail = e.code().name, (e.details() or "")[:200]


def run_config(a, g, gg, srv, longs):
    ch = grpc.insecure_channel(srv.addr, options=[("grpc.max_receive_message_length", 64 << 20)])
    stub = gg.GenerationStub(ch)
    # warm-up (not measured): a short and a long request, so first-call costs
    # (page faults in the weights, connections, the KV link) stay out
    wr = random.Random(12345)
    for n, k in ((64, 8), (1024, 4), (64, 8)):
        c = Call("warmup", -1, n)
        generate(g, stub, [wr.randrange(100, 20000) for _ in range(n)], k, c, 300)
        if c.code != "OK":
            raise RuntimeError(f"{srv.name}: warm-up request failed: {c.code} {c.detail}")
    http = {"router": srv.router_http, **srv.http}
    m0 = {k: scrape(v) for k, v in http.items()}
    cpu0, mc0, cl0 = srv.cpu(), machine_cpu(), time.process_time()
    load0 = os.getloadavg()
    calls, lock = [], threading.Lock()
    stop_chats = threading.Event()
    t0 = time.monotonic()
    t_end = t0 + a.duration

    def chat(i):
        prompts = chat_prompts(a, i)
        while not stop_chats.is_set():
            think, ids = next(prompts)
            if stop_chats.wait(think):
                break
            c = Call("chat", i, len(ids))
            generate(g, stub, ids, a.chat_max_tokens, c, a.timeout)
            with lock:
                calls.append(c)
            if c.code != "OK":
                time.sleep(0.5)  # do not spin on a failing server

    def long_one(j, ids):
        c = Call("long", j, len(ids))
        with lock:
            calls.append(c)
        generate(g, stub, ids, a.long_max_tokens, c, a.timeout)

    def arrivals():
        ts = []
        for j, (off, ids) in enumerate(longs):
            while time.monotonic() < t0 + off:
                time.sleep(min(0.05, t0 + off - time.monotonic()))
            th = threading.Thread(target=long_one, args=(j, ids), daemon=True)
            th.start()
            ts.append(th)
        for th in ts:
            th.join()

    threads = [threading.Thread(target=chat, args=(i,), daemon=True) for i in range(a.streams)]
    arr = threading.Thread(target=arrivals, daemon=True)
    for th in threads + [arr]:
        th.start()
    time.sleep(max(0.0, t_end - time.monotonic()))
    # keep the chats going until every long prompt has its first token (or ended)
    drain_deadline = t_end + a.drain
    while time.monotonic() < drain_deadline:
        with lock:
            longs_seen = [c for c in calls if c.kind == "long"]
        if len(longs_seen) == len(longs) and all(c.msgs or c.code != "OK" or c.finish for c in longs_seen):
            break
        time.sleep(0.1)
    t_stop = time.monotonic()
    stop_chats.set()
    for th in threads:
        th.join(a.timeout + 10)
    arr.join(a.timeout + 10)
    t_join = time.monotonic()
    cpu1, mc1, cl1 = srv.cpu(), machine_cpu(), time.process_time()
    m1 = {k: scrape(v) for k, v in http.items()}
    alive = srv.alive()
    ch.close()
    return analyse(a, srv, calls, longs, t0, t_end, t_stop, t_join, m0, m1, cpu0, cpu1, mc0, mc1, cl1 - cl0,
                   load0, alive)


def analyse(a, srv, calls, longs, t0, t_end, t_stop, t_join, m0, m1, cpu0, cpu1, mc0, mc1, client_cpu, load0,
            alive):
    wall = t_join - t0
    itl, itl_t, chat_ttft, multi_tok, tokens_win, chat_tokens_win = [], [], [], 0, 0, 0
    errors = {}
    for c in calls:
        if c.code != "OK":
            errors.setdefault(f"{c.kind}: {c.code}: {c.detail}", 0)
            errors[f"{c.kind}: {c.code}: {c.detail}"] += 1
        for t, k in c.msgs:
            if t <= t_end:
                tokens_win += k
                if c.kind == "chat":
                    chat_tokens_win += k
            if k > 1:
                multi_tok += k
        if c.kind != "chat":
            continue
        if c.msgs and c.t_send <= t_end:
            chat_ttft.append(c.msgs[0][0] - c.t_send)
        stamps = [t for t, k in c.msgs for _ in range(k)]
        for x, y in zip(stamps[:-1], stamps[1:]):
            if y <= t_end:
                itl.append(y - x)
                itl_t.append(y - t0)
    chat_calls = [c for c in calls if c.kind == "chat"]
    long_calls = sorted((c for c in calls if c.kind == "long"), key=lambda c: c.stream)
    lrows = []
    for c in long_calls:
        lrows.append({"arrival_s": c.t_send - t0, "prompt_tokens": c.n_prompt,
                      "ttft_s": c.msgs[0][0] - c.t_send if c.msgs else None,
                      "tokens": sum(k for _, k in c.msgs), "code": c.code})
    ttft = [r["ttft_s"] for r in lrows if r["ttft_s"] is not None]
    all_tokens = sum(k for c in calls for _, k in c.msgs)
    busy = (mc1[0] - mc0[0]) / CLK
    cpu = {k: ((cpu1[k] - cpu0[k]) / CLK if cpu1.get(k) is not None and cpu0.get(k) is not None else None)
           for k in cpu0}
    ours = sum(v for v in cpu.values() if v) + client_cpu
    res = {
        "name": srv.name, "argv": srv.argv, "wall_s": wall, "window_s": a.duration, "drain_s": t_stop - t_end,
        "itl_ms": {"p50": pct(itl, 50) * 1e3, "p99": pct(itl, 99) * 1e3, "max": max(itl, default=float("nan")) * 1e3,
                   "n": len(itl), "zero_gaps": sum(1 for x in itl if x == 0.0)},
        "tokens_in_multi_token_messages": multi_tok, "tokens_total": all_tokens,
        "chat_ttft_ms": {"p50": pct(chat_ttft, 50) * 1e3, "p99": pct(chat_ttft, 99) * 1e3, "n": len(chat_ttft)},
        "chat_requests_done": sum(1 for c in chat_calls if c.code == "OK" and c.finish),
        "long_ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99), "max": max(ttft, default=float("nan")),
                        "mean": sum(ttft) / len(ttft) if ttft else float("nan"), "n": len(ttft),
                        "sent": len(long_calls), "scheduled": len(longs)},
        "long": lrows,
        "output_tok_s": tokens_win / a.duration, "chat_tok_s": chat_tokens_win / a.duration,
        "errors": errors,
        "cpu_s": cpu, "client_cpu_s": client_cpu, "client_cpu_frac": client_cpu / wall,
        "machine_busy_cores": busy / wall, "machine_steal_cores": (mc1[2] - mc0[2]) / CLK / wall,
        "others_cores": max(0.0, busy - ours) / wall, "load_before": load0,
        "processes_alive_after": alive,
        "itl_samples": [[round(t, 3), round(x * 1e3, 2)] for t, x in zip(itl_t, itl)],
    }
    if srv.router_http:
        r0, r1 = m0.get("router", {}), m1.get("router", {})
        res["router_overhead"] = hist_summary(r0, r1, "chunkserve:router_overhead_seconds")
        res["router_to_worker"] = hist_summary(m0.get("decode", {}), m1.get("decode", {}),
                                               "chunkserve:router_to_worker_seconds")
        res["router"] = {"prefills_remote": r1.get("chunkserve:prefills_total", {}).get('{path="remote"}', 0)
                         - r0.get("chunkserve:prefills_total", {}).get('{path="remote"}', 0),
                         "prefills_local": r1.get("chunkserve:prefills_total", {}).get('{path="local"}', 0)
                         - r0.get("chunkserve:prefills_total", {}).get('{path="local"}', 0),
                         "retries": counter(r0, r1, "chunkserve:retries_total"),
                         "migrations": counter(r0, r1, "chunkserve:migrations_total"),
                         "requests_by_code": {k: v - r0.get("chunkserve:requests_total", {}).get(k, 0)
                                              for k, v in r1.get("chunkserve:requests_total", {}).items()
                                              if v - r0.get("chunkserve:requests_total", {}).get(k, 0)}}
        kv = {}
        for role in ("prefill", "decode"):
            b, e = m0.get(role, {}), m1.get(role, {})
            kv[role] = {"completed": counter(b, e, "chunkserve:kv_transfers_completed_total"),
                        "failed": counter(b, e, "chunkserve:kv_transfers_failed_total"),
                        "bytes": counter(b, e, "chunkserve:kv_transfer_bytes_total")}
        p0, p1 = m0.get("prefill", {}), m1.get("prefill", {})
        kv["prefill"]["transfer"] = hist_summary(p0, p1, "chunkserve:kv_transfer_seconds")
        kv["prefill"]["tail"] = hist_summary(p0, p1, "chunkserve:kv_transfer_tail_seconds")
        kv["prefill"]["backpressure_waits"] = counter(p0, p1, "chunkserve:kv_backpressure_waits_total")
        res["kv"] = kv
    return res


# ----------------------------------------------------------------- main ----

def busy_cores(seconds):
    b0, t0 = machine_cpu()[0], time.monotonic()
    time.sleep(seconds)
    return (machine_cpu()[0] - b0) / CLK / (time.monotonic() - t0)


def wait_quiet(limit, until):
    """Waits (until the monotonic deadline) for the machine to be idle: busy
    cores over 5 s below limit. Returns the last measure."""
    while True:
        b = busy_cores(5)
        if b < limit or time.monotonic() >= until:
            return b
        print(f"  machine busy {b:.2f} cores (others' work) >= {limit}: waiting", flush=True)
        time.sleep(10)


def wait_for_load(limit, max_wait):
    t = time.monotonic()
    while os.getloadavg()[0] >= limit and time.monotonic() - t < max_wait:
        print(f"  load {os.getloadavg()[0]:.2f} >= {limit}: waiting", flush=True)
        time.sleep(15)
    return os.getloadavg()


def fmt(x, nd=1):
    return "-" if x is None or x != x else f"{x:,.{nd}f}"


def itl_split(r):
    """Chat ITL while some long prompt waits for its first token (sent ->
    first token) vs the rest of the window: (n, p50, p99) each, ms."""
    win = [(x["arrival_s"], x["arrival_s"] + (x["ttft_s"] if x["ttft_s"] is not None else 1e9)) for x in r["long"]]
    during = [v for t, v in r["itl_samples"] if any(lo <= t <= hi for lo, hi in win)]
    other = [v for t, v in r["itl_samples"] if not any(lo <= t <= hi for lo, hi in win)]
    return [(len(v), pct(v, 50), pct(v, 99)) for v in (during, other)]


def report(results, a, discarded=()):
    base = results[0]
    for r in discarded:
        print(f"discarded attempt: {r['name']} (others used {r['others_cores']:.2f} cores): ITL p99 "
              f"{r['itl_ms']['p99']:.1f} ms, long TTFT p50 {r['long_ttft_s']['p50']:.2f} s, "
              f"{r['output_tok_s']:.1f} tok/s")
    print(f"\n{'config':16} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'ITL max ms':>10} {'TTFT p50 s':>10} "
          f"{'TTFT p99 s':>10} {'long':>6} {'out tok/s':>9} {'chat TTFT p50/p99 ms':>21} {'errors':>6}")
    for r in results:
        print(f"{r['name']:16} {fmt(r['itl_ms']['p50']):>10} {fmt(r['itl_ms']['p99']):>10} "
              f"{fmt(r['itl_ms']['max']):>10} {fmt(r['long_ttft_s']['p50'], 2):>10} "
              f"{fmt(r['long_ttft_s']['p99'], 2):>10} "
              f"{r['long_ttft_s']['n']:>2}/{r['long_ttft_s']['scheduled']:<3} {fmt(r['output_tok_s']):>9} "
              f"{fmt(r['chat_ttft_ms']['p50'], 0) + ' / ' + fmt(r['chat_ttft_ms']['p99'], 0):>21} "
              f"{sum(r['errors'].values()):>6}")
    print("\nchat ITL while a long prompt waits for its first token | the rest of the window:")
    for r in results:
        (n0, a50, a99), (n1, b50, b99) = itl_split(r)
        print(f"  {r['name']:16} {n0:5d} gaps p50 {fmt(a50)} ms p99 {fmt(a99)} ms | {n1:5d} gaps p50 {fmt(b50)} ms "
              f"p99 {fmt(b99)} ms")
    print(f"\nratios vs {base['name']} (same run):")
    for r in results[1:]:
        q = lambda k, s: r[k][s] / base[k][s] if base[k][s] else float("nan")
        print(f"  {r['name']:16} ITL p99 x{q('itl_ms', 'p99'):.2f}  ITL p50 x{q('itl_ms', 'p50'):.2f}  "
              f"long TTFT p50 x{q('long_ttft_s', 'p50'):.2f}  p99 x{q('long_ttft_s', 'p99'):.2f}  "
              f"tok/s x{r['output_tok_s'] / base['output_tok_s']:.2f}")
    for r in results:
        cpu = ", ".join(f"{k} {v / r['wall_s']:.2f}" for k, v in r["cpu_s"].items() if v is not None)
        print(f"\n{r['name']}: cores used: {cpu}, client {r['client_cpu_frac']:.3f}; machine busy "
              f"{r['machine_busy_cores']:.2f} of 2 (others {r['others_cores']:.2f}, steal "
              f"{r['machine_steal_cores']:.2f}); load before {r['load_before'][0]:.2f}; "
              f"{r['itl_ms']['n']} ITL samples ({r['itl_ms']['zero_gaps']} zero gaps), "
              f"{r['chat_requests_done']} chat answers; drain {r['drain_s']:.1f} s")
        if r["errors"]:
            for k, v in r["errors"].items():
                print(f"  ERROR x{v}: {k}")
        if not all(r["processes_alive_after"].values()):
            print(f"  PROCESS DIED: {r['processes_alive_after']}")
        if "router_overhead" in r:
            o = r["router_overhead"]
            print(f"  router overhead (receipt -> Decode call), {o['count']:.0f} requests: mean "
                  f"{o['mean_s'] * 1e3:.3f} ms, p50 {o['p50_s'] * 1e3:.3f} ms {o['p50_bucket']}, p99 "
                  f"{o['p99_s'] * 1e3:.3f} ms {o['p99_bucket']} (bucket-interpolated)")
            h = r.get("router_to_worker")
            if h and h["count"]:
                print(f"  router receipt -> decode worker receipt (wall clocks, one host), {h['count']:.0f} requests: "
                      f"mean {h['mean_s'] * 1e3:.3f} ms, p50 {h['p50_s'] * 1e3:.3f} ms {h['p50_bucket']}, p99 "
                      f"{h['p99_s'] * 1e3:.3f} ms {h['p99_bucket']} (bucket-interpolated)")
            rt = r["router"]
            print(f"  router: prefills remote {rt['prefills_remote']:.0f} local {rt['prefills_local']:.0f}, "
                  f"retries {rt['retries']:.0f}, migrations {rt['migrations']:.0f}, ended {rt['requests_by_code']}")
            kv = r["kv"]
            p = kv["prefill"]
            print(f"  KV: prefill sent {p['completed']:.0f} transfers ({p['failed']:.0f} failed), "
                  f"{p['bytes'] / 2**20:.1f} MiB; decode received {kv['decode']['completed']:.0f} "
                  f"({kv['decode']['bytes'] / 2**20:.1f} MiB); transfer (call -> trailer ack) mean "
                  f"{p['transfer']['mean_s']:.2f} s; exposed tail mean {p['tail']['mean_s'] * 1e3:.1f} ms, p50 "
                  f"{p['tail']['p50_s'] * 1e3:.1f} ms, p99 {p['tail']['p99_s'] * 1e3:.1f} ms "
                  f"{p['tail']['p99_bucket']}; "
                  f"backpressure waits {p['backpressure_waits']:.0f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/bin")
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--duration", type=float, default=60, help="seconds of measured load per configuration")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="cores: serve gets all, the cluster splits them")
    ap.add_argument("--streams", type=int, default=8, help="chat streams")
    ap.add_argument("--chat-min", type=int, default=30)
    ap.add_argument("--chat-max", type=int, default=100)
    ap.add_argument("--chat-max-tokens", type=int, default=64)
    ap.add_argument("--think", type=float, default=1.0,
                    help="mean seconds a chat stream waits before its next question (exponential)")
    ap.add_argument("--long-min", type=int, default=1500)
    ap.add_argument("--long-max", type=int, default=3000)
    ap.add_argument("--long-max-tokens", type=int, default=8)
    ap.add_argument("--long-gap", type=float, default=8, help="mean seconds between long prompts (Poisson)")
    ap.add_argument("--kv-cache-mib", type=int, default=1024, help="per process (serve) / per worker (cluster)")
    ap.add_argument("--configs", default="serve-512,serve-unlimited,cluster")
    ap.add_argument("--drain", type=float, default=120, help="most seconds to wait for late first tokens")
    ap.add_argument("--timeout", type=float, default=600, help="per-call gRPC deadline")
    ap.add_argument("--wait-load", type=float, default=0, help="wait until the 1-min load is below this")
    ap.add_argument("--wait-load-max", type=float, default=900,
                    help="most seconds of waiting for a quiet machine in the whole run; then it runs anyway")
    ap.add_argument("--quiet", type=float, default=0.3,
                    help="before each config wait (within --wait-load-max) until the machine's busy cores < this")
    ap.add_argument("--max-others", type=float, default=0.3,
                    help="rerun a config (at most --retries times) when other processes used more cores than this")
    ap.add_argument("--retries", type=int, default=2)
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--report", metavar="JSON", help="print the report of an earlier run's JSON and exit")
    a = ap.parse_args()
    os.chdir(ROOT)
    if a.report:
        d = json.loads(Path(a.report).read_text())
        report(d["runs"], a, d.get("discarded", []))
        return
    Path(a.out).mkdir(parents=True, exist_ok=True)
    g, gg = stubs()
    longs = schedule(a)
    exe = str(Path(a.bin) / "chunkserve")
    common = [f"--model={a.model}", f"--kv-cache-mib={a.kv_cache_mib}"]
    half = max(1, a.threads // 2)
    argvs = {
        "serve-512": [exe, "serve", *common, "--port=0", f"--threads={a.threads}", "--max-batched-tokens=512"],
        "serve-unlimited": [exe, "serve", *common, "--port=0", f"--threads={a.threads}",
                            "--max-batched-tokens=unlimited"],
        "cluster": [exe, "cluster", "up", *common, "--port=0", "--prefill=1", "--decode=1",
                    f"--prefill-threads={half}", f"--decode-threads={half}"],
    }
    configs = a.configs.split(",")
    print(f"bench_cluster: {a.streams} chat streams ({a.chat_min}-{a.chat_max} prompt tokens, "
          f"{a.chat_max_tokens} answer tokens, think time mean {a.think:g} s) + {len(longs)} long prompts "
          f"({a.long_min}-{a.long_max} tokens, {a.long_max_tokens} answer tokens, Poisson mean gap "
          f"{a.long_gap:g} s, seed {a.seed}) per config; {a.duration:g} s per config; {a.threads} cores; "
          f"model {a.model}", flush=True)
    print("long prompts (s: tokens): " + ", ".join(f"{t:.1f}: {len(ids)}" for t, ids in longs), flush=True)
    quiet_until = time.monotonic() + a.wait_load_max  # one waiting budget for the whole run
    load_start = wait_for_load(a.wait_load, a.wait_load_max) if a.wait_load else os.getloadavg()
    results, discarded = [], []
    for name in configs:
        attempts = []
        for attempt in range(a.retries + 1):
            idle = wait_quiet(a.quiet, quiet_until) if a.quiet else float("nan")
            print(f"\n== {name} (attempt {attempt + 1}; machine busy {idle:.2f} cores before): "
                  f"{' '.join(argvs[name])}", flush=True)
            srv = Server(name, argvs[name], f"{a.out}/bench_cluster_{name}.log")
            try:
                r = run_config(a, g, gg, srv, longs)
            finally:
                rc = srv.stop()
            r["exit_code"], r["banner"], r["attempt"], r["busy_before"] = rc, srv.banner, attempt + 1, idle
            print(f"   ITL p50 {r['itl_ms']['p50']:.1f} ms p99 {r['itl_ms']['p99']:.1f} ms, long TTFT p50 "
                  f"{r['long_ttft_s']['p50']:.2f} s p99 {r['long_ttft_s']['p99']:.2f} s, "
                  f"{r['output_tok_s']:.1f} tok/s, errors {sum(r['errors'].values())}, exit {rc}; other "
                  f"processes used {r['others_cores']:.2f} cores", flush=True)
            attempts.append(r)
            if r["others_cores"] <= a.max_others:
                break
            print(f"   other processes used {r['others_cores']:.2f} > {a.max_others} cores", flush=True)
        best = min(attempts, key=lambda x: x["others_cores"])  # the least disturbed attempt
        discarded += [x for x in attempts if x is not best]
        results.append(best)
    report(results, a, discarded)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    out = {"args": vars(a), "commit": commit, "load_start": load_start,
           "long_schedule": [[t, len(ids)] for t, ids in longs],
           "itl_rule": "k tokens in one message: k timestamps equal to its arrival (k-1 zero gaps)",
           "runs": results, "discarded": discarded}
    path = Path(a.out) / "bench_cluster.json"
    path.write_text(json.dumps(out, indent=1, default=float))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
