#!/usr/bin/env python3
"""HTTP/SSE next to gRPC on the same server, in one run (issue 16's measure).

For each configuration (`chunkserve serve`, and `chunkserve cluster up` = router + one prefill
+ one decode worker, both with the OpenAI-compatible API on), three clients of the same
request, taking turns so that machine noise falls on all of them alike:

  grpc    grpcio stubs generated from proto/ (chunkserve.v1.Generation/Generate)
  openai  the official openai client (its own httpx connection pool, keep-alive)
  raw     http.client on one keep-alive connection, SSE lines parsed by hand

Measured:
  stream   one greedy answer of --tokens tokens (ignore_eos) streamed, --repeat times per
           client: tokens/s over the whole request, and the time to the first token
  latency  --requests short requests (a 1-token answer to a short prompt, not streamed)
           per client: p50/p99/max of the request's wall time, and what HTTP adds to
           gRPC's p50/p99 (same server, same engine work)

Prints a Markdown table. Nothing here asserts a speed.

  python3 bench/bench_openai.py [--bin build/bin/chunkserve] [--model M] [--tokens 256]
                                [--repeat 5] [--requests 300] [--seed 1] [--configs serve,cluster]
"""
from __future__ import annotations

import argparse
import http.client
import importlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import openai
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def stubs():
    out = tempfile.mkdtemp(prefix="chunkserve-bench-")
    inc = Path(protoc.__file__).parent / "_proto"
    assert protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{inc}", f"--python_out={out}",
                        f"--grpc_python_out={out}", "chunkserve/v1/generation.proto"]) == 0
    sys.path.insert(0, out)
    return (importlib.import_module("chunkserve.v1.generation_pb2"),
            importlib.import_module("chunkserve.v1.generation_pb2_grpc"))


def pct(xs, p):
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


class Server:
    """`chunkserve serve` or `chunkserve cluster up` with the OpenAI API on a free port."""

    def __init__(self, name, argv, log_path, timeout=300):
        self.name, self.log = name, open(log_path, "w")
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  start_new_session=True)
        self.grpc = self.http = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (self.grpc and self.http):
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"{name}: exited while starting (log: {log_path})")
            m = re.search(r"openai listening on (\S+)", line)
            if m:
                self.http = m.group(1)
            if line.startswith("listening on "):
                self.grpc = line.split()[-1]
        if not (self.grpc and self.http):
            self.stop()
            raise RuntimeError(f"{name}: not listening after {timeout} s (log: {log_path})")
        threading.Thread(target=lambda: [None for _ in self.p.stdout], daemon=True).start()

    def stop(self):
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGINT)
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self.log.close()


class Clients:
    def __init__(self, srv, g, gg):
        self.g = g
        self.chan = grpc.insecure_channel(srv.grpc)
        self.stub = gg.GenerationStub(self.chan)
        self.oa = openai.OpenAI(base_url=f"http://{srv.http}/v1", api_key="none", max_retries=0)
        self.model = self.oa.models.list().data[0].id
        host, port = srv.http.rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=300)
        self.raw_used = time.monotonic()

    def close(self):
        self.oa.close()
        self.conn.close()
        self.chan.close()

    # Each returns (seconds to the first token or None, seconds in all, completion tokens).
    def grpc_call(self, max_tokens, stream):
        g = self.g
        t0 = time.perf_counter()
        first, n = None, 0
        req = g.GenerateRequest(chat=g.Chat(messages=[g.ChatMessage(role="user", content=PROMPT)]),
                                sampling=g.SamplingParams(temperature=0, max_tokens=max_tokens,
                                                          ignore_eos=True))
        for m in self.stub.Generate(req, timeout=600):
            if m.token_ids and first is None:
                first = time.perf_counter() - t0
            n += len(m.token_ids)
        return first, time.perf_counter() - t0, n

    def openai_call(self, max_tokens, stream):
        t0 = time.perf_counter()
        kw = dict(model=self.model, messages=[{"role": "user", "content": PROMPT}], temperature=0,
                  max_tokens=max_tokens, extra_body={"ignore_eos": True})
        if not stream:
            r = self.oa.chat.completions.create(**kw)
            return None, time.perf_counter() - t0, r.usage.completion_tokens
        first, n = None, 0
        for ch in self.oa.chat.completions.create(**kw, stream=True,
                                                  stream_options={"include_usage": True}):
            if ch.choices and ch.choices[0].delta.content and first is None:
                first = time.perf_counter() - t0
            if ch.usage:
                n = ch.usage.completion_tokens
        return first, time.perf_counter() - t0, n

    def raw_call(self, max_tokens, stream):
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": PROMPT}],
                           "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": stream, "stream_options": {"include_usage": True} if stream else None})
        body = body.replace(', "stream_options": null', "")
        if time.monotonic() - self.raw_used > 20:  # the server closes keep-alives idle 30 s
            self.conn.close()  # http.client connects again on the next request
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/chat/completions", body,
                          {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"raw: HTTP {r.status}: {r.read()[:200]!r}")
        if not stream:
            n = json.loads(r.read())["usage"]["completion_tokens"]
            self.raw_used = time.monotonic()
            return None, time.perf_counter() - t0, n
        first, n = None, 0
        while True:
            line = r.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                r.read()  # the terminating chunk: the connection is ready for the next request
                break
            ev = json.loads(line[6:])
            if ev["choices"] and ev["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter() - t0
            if ev.get("usage"):
                n = ev["usage"]["completion_tokens"]
        self.raw_used = time.monotonic()
        return first, time.perf_counter() - t0, n


DOORS = ("grpc", "openai", "raw")


def run(srv, g, gg, a, rng):
    c = Clients(srv, g, gg)
    call = {"grpc": c.grpc_call, "openai": c.openai_call, "raw": c.raw_call}
    try:
        for d in DOORS:  # warm-up: connections, the prompt's KV in the prefix cache
            call[d](4, True)
        stream = {d: [] for d in DOORS}
        for _ in range(a.repeat):
            order = list(DOORS)
            rng.shuffle(order)
            for d in order:
                first, total, n = call[d](a.tokens, True)
                if n != a.tokens:
                    raise RuntimeError(f"{d}: {n} tokens, asked {a.tokens}")
                stream[d].append((n / total, first))
        lat = {d: [] for d in DOORS}
        for _ in range(a.requests):
            order = list(DOORS)
            rng.shuffle(order)
            for d in order:
                _, total, n = call[d](1, False)
                lat[d].append(total * 1e3)
        return stream, lat
    finally:
        c.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "build/bin/chunkserve"))
    ap.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--configs", default="serve,cluster")
    a = ap.parse_args()
    g, gg = stubs()
    rng = random.Random(a.seed)
    logs = Path(tempfile.mkdtemp(prefix="bench-openai-"))
    argvs = {
        "serve": [a.bin, "serve", "--model", a.model, "--port", "0", "--openai-port", "0",
                  "--threads", str(a.threads)],
        "cluster": [a.bin, "cluster", "up", "--model", a.model, "--port", "0", "--openai-port", "0",
                    "--prefill", "1", "--decode", "1",
                    "--prefill-threads", str(max(1, a.threads // 2)),
                    "--decode-threads", str(max(1, a.threads // 2))],
    }
    rows = []
    for name in a.configs.split(","):
        srv = Server(name, argvs[name], logs / f"{name}.log")
        try:
            stream, lat = run(srv, g, gg, a, rng)
        finally:
            srv.stop()
        base = {p: pct(lat["grpc"], p) for p in (50, 99)}
        for d in DOORS:
            tps = [x[0] for x in stream[d]]
            ttft = [x[1] * 1e3 for x in stream[d]]
            rows.append((name, d, statistics.median(tps), statistics.median(tps) /
                         statistics.median([x[0] for x in stream["grpc"]]), statistics.median(ttft),
                         pct(lat[d], 50), pct(lat[d], 99), max(lat[d]),
                         pct(lat[d], 50) - base[50], pct(lat[d], 99) - base[99]))
    print(f"\nmodel {Path(a.model).name}, {a.tokens}-token streams x{a.repeat}, "
          f"{a.requests} 1-token requests per client, seed {a.seed}, logs {logs}\n")
    print("| config | client | stream tok/s (p50) | vs grpc | TTFT ms (p50) | request ms p50 | p99 | max "
          "| added p50 | added p99 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.3f} | {r[4]:.1f} | {r[5]:.2f} | {r[6]:.2f} | "
              f"{r[7]:.2f} | {r[8]:+.2f} | {r[9]:+.2f} |")


if __name__ == "__main__":
    main()
