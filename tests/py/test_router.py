"""`chunkserve-router` against real gRPC clients (grpcio stubs generated from proto/).

Two parts:
- the router alone, with no worker at all: input validation without workers, the unary
  calls it answers itself, a prompt UNAVAILABLE (no hang) when no worker exists, its HTTP
  endpoints, SIGTERM;
- the router in front of real chunkserve-prefill / chunkserve-decode processes on the tiny
  random-weight model (tests/py/cluster_harness.py): local and remote prefill, refusals,
  pools too small, retries, migration without duplicates, hung (SIGSTOP) and killed (-9)
  workers, the admission lease, cancellation and deadlines reaching the workers, overload,
  SIGTERM with streams, DNS discovery, workers of another role or model, restarts.  Greedy
  ids must equal single-process `chunkserve serve` on the same model.

Timing bounds are generous: they catch hangs only.  No test asserts a speed.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_tools.protoc")  # stubs: conftest.proto_modules

from cluster_harness import (Cluster, Proc, Reference, exported_series,  # noqa: E402
                             generate, make_tiny, metric, wait_for, wait_idle, wait_metric,
                             worker_status)
from refusals import FIELD_CASES, generate_request, refusal_field  # noqa: E402

pytestmark = pytest.mark.cluster

SERVICE = "chunkserve.v1.Generation"
TINY_NAME = "chunkserve tiny test model"
TINY_VOCAB = 349
TINY_CTX = 4096


@pytest.fixture(scope="module")
def pb(proto_modules):
    return type("PB", (), proto_modules)


@pytest.fixture(scope="module")
def router_bin(bin_dir):
    exe = bin_dir / "chunkserve-router"
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        pytest.skip(f"chunkserve-router not built: {exe} missing")
    return exe


@pytest.fixture(scope="module")
def tiny_model(bin_dir, tmp_path_factory):
    if not (bin_dir / "chunkserve-mktiny").is_file():
        pytest.skip(f"{bin_dir / 'chunkserve-mktiny'} not built")
    return make_tiny(bin_dir, tmp_path_factory.mktemp("tiny"))


class Router:
    """A chunkserve-router process, its gRPC stub and its HTTP address.  stderr goes to a
    file (a pipe nobody reads would fill and block it)."""

    def __init__(self, exe: Path, model: Path, pb, *args):
        self.pb = pb
        self.stopped = False
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([str(exe), "--model", str(model), "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=self.err)
        lines = [self.proc.stdout.readline().decode() for _ in range(2)]
        if not lines[0].startswith("listening on ") or not lines[1].startswith("http listening on "):
            self.proc.kill()
            pytest.fail(f"unexpected first lines {lines!r}; stderr: {self.stderr()[-3000:]!r}")
        self.addr = lines[0].split()[-1]
        self.http = lines[1].split()[-1]
        self.channel = grpc.insecure_channel(self.addr)
        self.stub = pb.generation_pb2_grpc.GenerationStub(self.channel)

    def get(self, path):
        """(status, body) of GET http://.../path."""
        try:
            with urllib.request.urlopen(f"http://{self.http}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name):
        """The value of one series ('chunkserve:retries_total', 'x{code="OK"}'), or None."""
        _, text = self.get("/metrics")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return None

    def wait_ready(self, timeout=10.0):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.get("/readyz")[0] == 200:
                return
            time.sleep(0.05)
        pytest.fail(f"router not ready within {timeout}s: {self.get('/readyz')}; "
                    f"stderr: {self.stderr()[-3000:]}")

    def stop(self, timeout=20.0):
        """SIGTERM; asserts exit 0 within timeout and no sanitizer report."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.wait_exit(timeout)
        return time.monotonic() - t0

    def wait_exit(self, timeout=20.0):
        """Waits for the exit a SIGTERM already sent causes; asserts exit 0 and no sanitizer
        report.  (A second SIGTERM during shutdown kills the router at once, by design.)"""
        t0 = time.monotonic()
        self.stopped = True
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"router did not exit within {timeout}s of SIGTERM: {self.stderr()[-3000:]}")
        self.channel.close()
        err = self.stderr()
        assert rc == 0, f"router exit {rc}: {err[-3000:]}"
        assert "Sanitizer" not in err and "runtime error:" not in err, err[-6000:]
        return time.monotonic() - t0

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")


@pytest.fixture
def start_router(router_bin, tiny_model, pb):
    """start_router(*flags) -> Router; every router is stopped (exit 0 checked) at the end."""
    routers = []

    def start(*args):
        r = Router(router_bin, tiny_model, pb, *args)
        routers.append(r)
        return r

    yield start
    for r in routers:
        if r.stopped:
            continue
        if r.proc.poll() is not None:
            pytest.fail(f"router exited {r.proc.returncode} on its own: {r.stderr()[-4000:]}")
        r.stop()


@pytest.fixture(scope="module")
def alone(router_bin, tiny_model, pb):
    """A router with no worker at all."""
    r = Router(router_bin, tiny_model, pb)
    yield r
    r.stop()


def collect(stream):
    msgs = list(stream)
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs), msgs


# ============================================================ the router alone --

def test_list_models_tokenize_detokenize(alone, pb):
    g = pb.generation_pb2
    r = alone.stub.ListModels(g.ListModelsRequest(), timeout=5)
    assert len(r.models) == 1
    m = r.models[0]
    assert (m.name, m.context_length, m.vocab_size, m.architecture) == (TINY_NAME, TINY_CTX, TINY_VOCAB, "llama")
    assert m.has_chat_template
    for text in ("Hello, world!", "naïve café — 你好 🙂"):
        ids = alone.stub.Tokenize(g.TokenizeRequest(text=text), timeout=5).ids
        assert len(ids) > 0
        assert alone.stub.Detokenize(g.DetokenizeRequest(ids=ids), timeout=5).text == text
    chat = g.Chat(messages=[g.ChatMessage(role="user", content="hi")])
    ids = alone.stub.Tokenize(g.TokenizeRequest(model="tiny.gguf", chat=chat), timeout=5).ids
    text = alone.stub.Detokenize(g.DetokenizeRequest(model=TINY_NAME, ids=ids, include_special=True),
                                 timeout=5).text
    assert "hi" in text and text.startswith("<|im_start|>")
    with pytest.raises(grpc.RpcError) as e:
        alone.stub.Detokenize(g.DetokenizeRequest(ids=[1, TINY_VOCAB]), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ids[1] = 349" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        alone.stub.Tokenize(g.TokenizeRequest(model="gpt-9", text="x"), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown model" in e.value.details()


def test_health_serving(alone, pb):
    h = pb.health_pb2
    check = alone.channel.unary_unary("/grpc.health.v1.Health/Check",
                                      request_serializer=h.HealthCheckRequest.SerializeToString,
                                      response_deserializer=h.HealthCheckResponse.FromString)
    for service in ("", SERVICE):
        assert check(h.HealthCheckRequest(service=service), timeout=5).status == h.HealthCheckResponse.SERVING


BAD_INPUTS = [
    (dict(prompt=""), "prompt is empty"),
    (dict(), "sets no input"),
    (dict(model="gpt-9", prompt="x"), "unknown model"),
    (dict(token_ids=dict(ids=[1, 2, 349])), "token_ids.ids[2] = 349"),
    (dict(token_ids=dict(ids=[-1])), "token_ids.ids[0] = -1"),
    (dict(token_ids=dict(ids=[])), "token_ids is empty"),
    (dict(token_ids=dict(ids=[5] * TINY_CTX)), "context"),
    (dict(prompt="x", sampling=dict(temperature=-1)), "temperature"),
    (dict(prompt="x", sampling=dict(top_p=1.5)), "top_p"),
    (dict(prompt="x", sampling=dict(max_tokens=-1)), "max_tokens"),
    (dict(prompt="x", sampling=dict(stop_token_ids=[400])), "stop_token_ids"),
    (dict(chat=dict(messages=[])), "no messages"),
]


@pytest.mark.parametrize("fields,words", BAD_INPUTS, ids=[w for _, w in BAD_INPUTS])
def test_bad_input_without_workers(alone, pb, fields, words):
    """Refused INVALID_ARGUMENT with the message, at once, although no worker exists."""
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(alone.stub.Generate(generate_request(pb, fields), timeout=20))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert words in e.value.details()
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("fields,field", FIELD_CASES[:4] + FIELD_CASES[-4:],
                         ids=[f for _, f in FIELD_CASES[:4] + FIELD_CASES[-4:]])
def test_refusal_names_the_field(alone, pb, fields, field):
    """The router's own refusals carry the field in the same trailer as serve's."""
    assert refusal_field(alone.stub, pb, fields) == field


def test_no_worker_is_unavailable_promptly(alone, pb):
    """No worker: UNAVAILABLE after --no-worker-wait-ms (2 s), not at the client's 20 s deadline."""
    g = pb.generation_pb2
    before = alone.metric('chunkserve:requests_total{code="UNAVAILABLE"}')
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(alone.stub.Generate(g.GenerateRequest(prompt="hello"), timeout=20))
    took = time.monotonic() - t0
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "no decode worker" in e.value.details()
    assert took < 5, f"took {took:.1f} s: the router hung instead of failing fast"
    assert alone.metric('chunkserve:requests_total{code="UNAVAILABLE"}') == before + 1


def test_http_endpoints_alone(alone, pb):
    assert alone.get("/healthz") == (200, "ok\n") or alone.get("/healthz")[0] == 200
    code, body = alone.get("/readyz")
    assert code == 503 and "no usable decode worker" in body
    code, text = alone.get("/metrics")
    assert code == 200
    for name in ("chunkserve:num_requests_running", "chunkserve:num_requests_waiting",
                 'chunkserve:requests_total{code="OK"}', 'chunkserve:prefills_total{path="local"}',
                 'chunkserve:prefills_total{path="remote"}', "chunkserve:retries_total",
                 "chunkserve:migrations_total", "chunkserve:time_to_first_token_seconds_bucket",
                 "chunkserve:inter_token_latency_seconds_bucket",
                 "chunkserve:e2e_request_latency_seconds_bucket",
                 "chunkserve:router_overhead_seconds_bucket", "chunkserve:prompt_tokens_total",
                 "chunkserve:generation_tokens_total", 'chunkserve:workers_usable{role="prefill"}',
                 'chunkserve:workers_usable{role="decode"}'):
        assert name in text, name
    assert alone.metric('chunkserve:workers_usable{role="decode"}') == 0
    # bad input is counted too
    before = alone.metric('chunkserve:requests_total{code="INVALID_ARGUMENT"}')
    with pytest.raises(grpc.RpcError):
        list(alone.stub.Generate(pb.generation_pb2.GenerateRequest(prompt=""), timeout=5))
    assert alone.metric('chunkserve:requests_total{code="INVALID_ARGUMENT"}') == before + 1


def test_sigterm_ends_waiting_requests(start_router, pb):
    """A request waiting for a worker when SIGTERM arrives ends UNAVAILABLE (after the grace
    period), and the router exits 0."""
    r = start_router("--no-worker-wait-ms", "60000", "--grace-ms", "500")
    g = pb.generation_pb2
    result = {}

    def call():
        try:
            list(r.stub.Generate(g.GenerateRequest(prompt="hello"), timeout=30))
            result["code"] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            result["code"] = e.code()

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.5)
    assert r.metric("chunkserve:num_requests_waiting") == 1
    took = r.stop()
    t.join(10)
    assert result["code"] == grpc.StatusCode.UNAVAILABLE
    assert took < 10


def test_sigterm_during_a_burst_being_tokenized(start_router, pb):
    """Prompts are tokenized on the thread pool (api/prepare.h), not on the loop thread: 16
    clients send 200 text and chat prompts (some too long for the context, refused after
    tokenization) at a router with no worker, and SIGTERM arrives mid-burst.  Every call
    ends with a status of the contract (INVALID_ARGUMENT for the long ones, UNAVAILABLE for
    the rest: no worker, or the router stopping), Tokenize calls in the burst answer the
    same ids as alone, and the router exits 0 (no sanitizer report: the drain waited for
    the requests being tokenized)."""
    r = start_router("--no-worker-wait-ms", "300", "--grace-ms", "1000")
    g = pb.generation_pb2
    long_text = "the quick brown fox jumps over the lazy dog " * 400  # past the context
    want = r.stub.Tokenize(g.TokenizeRequest(text="hello world " * 50), timeout=10).ids
    codes, errors = {}, []
    lock = threading.Lock()

    def client(k):
        for i in range(200 // 16 + 1):
            try:
                if i % 4 == 3:
                    got = r.stub.Tokenize(g.TokenizeRequest(text="hello world " * 50), timeout=30).ids
                    if list(got) != list(want):
                        errors.append("Tokenize differs in the burst")
                    continue
                if i % 3 == 0:
                    req = g.GenerateRequest(prompt=long_text)
                elif i % 3 == 1:
                    req = g.GenerateRequest(chat=g.Chat(messages=[g.ChatMessage(
                        role="user", content=f"question {k} {i} " * 30)]))
                else:
                    req = g.GenerateRequest(prompt=f"prompt {k} {i} " * 40)
                list(r.stub.Generate(req, timeout=30))
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
            except ValueError:  # r.stop() closed the client channel: the burst is over
                return
            with lock:
                codes[code] = codes.get(code, 0) + 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    r.stop()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert not errors, errors
    # CANCELLED: calls gRPC core had received but not yet handed to the server when it shut
    # down (grpc/grpc#41785: core ends them CANCELLED, not UNAVAILABLE; the old router too)
    assert set(codes) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE,
                          grpc.StatusCode.CANCELLED}, codes
    assert codes.get(grpc.StatusCode.CANCELLED, 0) <= 16, codes
    assert codes.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 0, codes


def test_bad_flags(router_bin, tiny_model):
    def run(*args, env=None):
        return subprocess.run([str(router_bin), *args], capture_output=True, timeout=30,
                              env=env)
    env = {k: v for k, v in os.environ.items() if k != "CHUNKSERVE_MODEL"}
    p = run(env=env)
    assert p.returncode == 2 and b"--model" in p.stderr
    p = run("--model", str(tiny_model), "--port", "abc")
    assert p.returncode == 2 and b"--port" in p.stderr
    p = run("--model", str(tiny_model), "--port", "0", "--decode-workers", "nohostport")
    assert p.returncode == 1 and b"nohostport" in p.stderr
    p = run("--model", "/nonexistent.gguf", "--port", "0")
    assert p.returncode == 1
    p = run("--help")
    assert p.returncode == 0
    for flag in (b"--decode-workers", b"--prefill-dns", b"--local-prefill-threshold",
                 b"--max-inflight", b"--no-worker-wait-ms", b"CHUNKSERVE_MAX_QUEUE"):
        assert flag in p.stdout, flag
    # the model from the environment
    env = dict(os.environ, CHUNKSERVE_MODEL=str(tiny_model))
    proc = subprocess.Popen([str(router_bin), "--port", "0"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdout.readline().startswith(b"listening on ")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0


# ====================================================== behind real workers --
#
# Real chunkserve-prefill / chunkserve-decode processes on the tiny model, started per test
# (they start in well under a second). Expected tokens are the single-process greedy ids of
# `chunkserve serve` on the same model (the `reference` fixture), compared by id.  Failures
# are real: kill -9, SIGSTOP (a hung process: its sockets stay open and nothing answers),
# restarts on the same port, and pools too small to admit.  What the router sent a worker is
# checked through what is observable: the workers' /metrics counters and log lines, the
# router's metrics and its debug log ("decode on ADDR", "prefill N tokens on ADDR").
#
# Timing: every wait polls for its condition with a generous bound.  Tests that act "mid
# stream" use streams of ~4,000 tokens (the context is 4,096) and act right after the first
# message.  Tests that need a request to be placed on a stopped worker stop it just after
# its status was seen, with a status interval that keeps its last status fresh for seconds.

LONG = 4000  # tokens of a "long" stream: prompt + LONG stays inside the 4,096 context
LONG_PROMPT = [11, 12, 13]  # the prompt of every long stream checked to the end (one reference)
WORKER_FAST = ["--threads=1", "--grace-ms=2000"]
FAST = ["--status-interval-ms", "100", "--no-worker-wait-ms", "1500", "--queue-timeout-ms", "1500"]
# A status interval of 1 s keeps a stopped worker's last status fresh (usable) for >= 2 s
# (stale after 2 intervals + 1 s), and declares it down only after 5 s.
SLOW_STATUS = ["--status-interval-ms", "1000", "--no-worker-wait-ms", "1500",
               "--queue-timeout-ms", "1500", "--log-level", "debug"]


@pytest.fixture(scope="module")
def worker_bins(bin_dir):
    for b in ("chunkserve-router", "chunkserve-prefill", "chunkserve-decode", "chunkserve"):
        if not (bin_dir / b).is_file():
            pytest.skip(f"{b} not built")
    return bin_dir


@pytest.fixture(scope="module")
def reference(worker_bins, tiny_model, pb):
    ref = Reference(worker_bins / "chunkserve", tiny_model, pb)
    yield ref
    ref.stop()


class Procs:
    """The processes of one test: decode and prefill workers (harness Procs) and routers
    (Procs too, with a gRPC stub).  stop() ends routers first, then workers, each with
    SIGTERM (a paused one is resumed first): exit 0 (-9 only for one the test killed and
    did not restart) and no sanitizer report."""

    def __init__(self, bin_dir: Path, model: Path, pb):
        self.bin, self.model, self.pb = bin_dir, model, pb
        self.workers, self.routers, self.channels = [], [], []
        self.n = {"decode": 0, "prefill": 0}

    def worker(self, role, *args, mib=16, model=None):
        name = f"{role}-{self.n[role]}"
        self.n[role] += 1
        p = Proc(self.bin / f"chunkserve-{role}",
                 [f"--model={model or self.model}", "--port=0", f"--kv-cache-mib={mib}",
                  *WORKER_FAST, *args], name)
        self.workers.append(p)
        return p

    def decode(self, *args, **kw):
        return self.worker("decode", *args, **kw)

    def prefill(self, *args, **kw):
        return self.worker("prefill", *args, **kw)

    def router(self, *args):
        r = Proc(self.bin / "chunkserve-router",
                 [f"--model={self.model}", "--port=0", "--grace-ms=2000", *args], "router")
        ch = grpc.insecure_channel(r.addr)
        self.channels.append(ch)
        r.stub = self.pb.generation_pb2_grpc.GenerationStub(ch)
        self.routers.append(r)
        return r

    def stop(self):
        for ch in self.channels:
            ch.close()
        errs = []
        for p in [*self.routers, *self.workers]:
            rc = p.stop()
            err = p.stderr()
            if rc != (-9 if p.killed else 0) or "Sanitizer" in err or "runtime error:" in err:
                errs.append(f"{p.name} exit {rc}: {err[-4000:]}")
        assert not errs, "\n".join(errs)


@pytest.fixture
def cl(worker_bins, tiny_model, pb):
    c = Procs(worker_bins, tiny_model, pb)
    yield c
    c.stop()


def usable(r, role):
    return metric(r.metrics(), "chunkserve:workers_usable", f'role="{role}"')


def wait_usable(r, n_decode, n_prefill=0, timeout=60):
    wait_for(lambda: usable(r, "decode") == n_decode and usable(r, "prefill") == n_prefill,
             timeout, f"the router to see {n_decode} decode + {n_prefill} prefill workers usable")


def readyz(r):
    try:
        with urllib.request.urlopen(r.http + "/readyz", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def gen(pb, ids, max_tokens, **sampling):
    g = pb.generation_pb2
    sampling.setdefault("ignore_eos", True)
    return g.GenerateRequest(token_ids=g.TokenIds(ids=ids),
                             sampling=g.SamplingParams(max_tokens=max_tokens, **sampling))


def run(r, pb, ids, n, timeout=120, **sampling):
    """(ids, text, messages) of one whole stream through router r (greedy unless sampling
    says otherwise)."""
    got, text, _, msgs = generate(r.stub, pb.generation_pb2, ids=ids, max_tokens=n,
                                  timeout=timeout, ignore_eos=True, **sampling)
    return got, text, msgs


def rest(it, ids):
    """Reads the remaining messages of stream it; returns ids + their tokens."""
    ids = list(ids)
    for m in it:
        ids += m.token_ids
    return ids


def placed_on(r, addr):
    """How many Decode calls the router (--log-level debug) opened on addr."""
    return r.stderr().count(f": decode on {addr}, ")


def prefilled_on(r, addr):
    return len(re.findall(rf": prefill \d+ tokens on {re.escape(addr)} ", r.stderr()))


def wait_placed(r, want, others, what):
    """Waits for the router's debug log to show a Decode call on want; fails at once if it
    shows one on another worker first (the stopped worker's status went stale before the
    request arrived: the premise of the test did not hold)."""
    def seen():
        for o in others:
            if placed_on(r, o.addr):
                pytest.fail(f"{what}: the router placed the request on {o.name}, not on "
                            f"{want.name}; router log: {r.stderr()[-3000:]}")
        return placed_on(r, want.addr) > 0
    wait_for(seen, 30, f"{what}: a Decode call on {want.name}")


def local_prefills(p):
    return p.metric("chunkserve:prefills_total", 'path="local"')


def remote_prefills(p):
    return p.metric("chunkserve:prefills_total", 'path="remote"')


def log_line(p, request_id, contains=""):
    """The worker's end-of-request log line for request_id that contains `contains`, waited
    for (a worker logs a request's end after its last message went out)."""
    def find():
        for line in p.stderr().splitlines():
            if f"request {request_id} (transfer " in line and contains in line:
                return line
        return ""
    return wait_for(find, 30, f"{p.name} to log the end of {request_id} with {contains!r}")


def test_local_prefill_stream(cl, pb, reference):
    d = cl.decode()
    r = cl.router("--decode-workers", d.addr, *FAST)
    wait_usable(r, 1)
    prompt = [1, 40, 258, 7]
    ids, text, msgs = run(r, pb, prompt, 12)
    assert (ids, text) == reference(prompt, 12)
    rid = msgs[0].request_id
    assert rid.startswith("rt-") and all(m.request_id == "" for m in msgs[1:])
    assert msgs[-1].finish_reason == pb.generation_pb2.FINISH_REASON_LENGTH
    assert (msgs[-1].usage.prompt_tokens, msgs[-1].usage.completion_tokens) == (4, 12)
    # the worker got the router's request id, prefilled locally and generated exactly 12
    log_line(d, rid, ", local prefill): length, 4 + 12 tokens")
    # the client's own id is used as is, and reaches the worker
    g = pb.generation_pb2
    msgs = list(r.stub.Generate(g.GenerateRequest(request_id="client-7", prompt="hello",
                                                  sampling=g.SamplingParams(max_tokens=2, ignore_eos=True)),
                                timeout=60))
    assert msgs[0].request_id == "client-7"
    t1 = re.search(r"\(transfer (\w+),", log_line(d, rid)).group(1)
    t2 = re.search(r"\(transfer (\w+),", log_line(d, "client-7", ", local prefill): length")).group(1)
    assert t1 != t2 and int(t1, 16) and int(t2, 16)  # a new, non-zero transfer id each
    m, dm = r.metrics(), d.metrics()
    assert metric(m, "chunkserve:prefills_total", 'path="local"') == 2
    assert metric(m, "chunkserve:prefills_total", 'path="remote"') == 0
    assert metric(m, "chunkserve:requests_total", 'code="OK"') == 2
    assert metric(m, "chunkserve:generation_tokens_total") == 14
    assert metric(m, "chunkserve:time_to_first_token_seconds_count") == 2
    assert metric(m, "chunkserve:router_overhead_seconds_count") == 2
    assert metric(m, "chunkserve:num_requests_running") == 0
    assert metric(dm, "chunkserve:prefills_total", 'path="local"') == 2
    assert metric(dm, "chunkserve:prefills_total", 'path="remote"') == 0
    assert metric(dm, "chunkserve:generation_tokens_total") == 14
    wait_idle(pb, [d])


def test_remote_prefill(pb, reference, worker_bins, tiny_model):
    """The harness's Cluster (1 prefill + 1 decode): a context at or above the threshold is
    prefilled on the prefill worker and its KV sent to the decode worker; below, locally."""
    c = Cluster(worker_bins, tiny_model, pb, n_prefill=1, n_decode=1, kv_cache_mib=16,
                router_args=["--local-prefill-threshold=8"])
    try:
        (p,), (d,) = c.prefill, c.decode
        g = pb.generation_pb2
        long_prompt = list(range(20, 60))
        ids, text, finish, msgs = generate(c.stub, g, ids=long_prompt, max_tokens=5, ignore_eos=True)
        assert (ids, text) == reference(long_prompt, 5)
        assert msgs[-1].usage.prompt_tokens == 40 and msgs[-1].usage.completion_tokens == 5
        rid = msgs[0].request_id
        wait_metric(p, "chunkserve:kv_transfers_completed_total", "", 1)
        pm, dm = p.metrics(), d.metrics()
        assert metric(pm, "chunkserve:prefill_requests_total") == 1
        assert metric(dm, "chunkserve:kv_transfers_completed_total") == 1
        assert metric(dm, "chunkserve:kv_transfer_bytes_total") > 0
        assert metric(dm, "chunkserve:prefills_total", 'path="remote"') == 1
        assert metric(dm, "chunkserve:prefills_total", 'path="local"') == 0
        # one transfer: the same request and transfer id on both workers, the whole context
        # sent to this decode worker (its id in the prefill worker's log)
        pl, dl = log_line(p, rid), log_line(d, rid)
        tp = re.search(r"\(transfer (\w+)\)", pl).group(1)
        assert f"(transfer {tp}, remote prefill): length, 40 + 5 tokens" in dl
        sd = c.status(d)
        assert ": 40 tokens " in pl and f"to {sd.worker_id} " in pl
        # under the threshold: local, the prefill worker is not asked
        ids, text, _, _ = generate(c.stub, g, ids=[3, 4, 5], max_tokens=3, ignore_eos=True)
        assert (ids, text) == reference([3, 4, 5], 3)
        assert metric(p.metrics(), "chunkserve:prefill_requests_total") == 1
        assert metric(d.metrics(), "chunkserve:prefills_total", 'path="local"') == 1
        # (the router's prefills_total{path="remote"}: see test_router_counts_remote_prefills)
        assert metric(c.router.metrics(), "chunkserve:prefills_total", 'path="local"') == 1
        c.wait_idle()
    finally:
        c.stop()


def prompt_logprobs(msgs):
    """[(token, logprob, rank, [alternative ids])] of the one message that carries them,
    which must be the first with tokens."""
    carrying = [i for i, m in enumerate(msgs) if m.prompt_logprobs]
    first = next(i for i, m in enumerate(msgs) if m.token_ids)
    assert carrying == [first], (carrying, first)
    return [(e.token_id, e.logprob, e.rank, [a.token_id for a in e.top_logprobs])
            for e in msgs[first].prompt_logprobs]


def test_prompt_logprobs_through_the_cluster(cl, pb, reference):
    """prompt_logprobs are computed where the prompt is prefilled: by the prefill worker
    (they come in its reply; the router holds the Decode stream's first output until then,
    even when the whole answer is one token) or by the decode worker (local prefill), and
    reach the client once, on the first message, as the single process gives them
    (test_migration.py: across cuts)."""
    g = pb.generation_pb2
    d, p = cl.decode(), cl.prefill()
    r = cl.router("--decode-workers", d.addr, "--prefill-workers", p.addr,
                  "--local-prefill-threshold", "8", "--log-level", "debug", *FAST)
    wait_usable(r, 1, 1)
    sp = dict(prompt_logprobs=True, prompt_top_logprobs=2)
    for prompt in ([1, 40, 258, 7], list(range(20, 60))):  # local, remote
        _, _, _, want = generate(reference.stub, g, ids=prompt, max_tokens=6, ignore_eos=True,
                                 **sp)
        want = prompt_logprobs(want)
        assert [t for t, _, _, _ in want] == prompt[1:]
        for n in (6, 1):
            got_ids, _, _, msgs = generate(r.stub, g, ids=prompt, max_tokens=n,
                                           ignore_eos=True, **sp)
            assert got_ids == reference(prompt, 6)[0][:n]
            got = prompt_logprobs(msgs)
            # the tiny model's fp32 kernels: equal to rounding, not bit for bit
            assert [(t, rk) for t, _, rk, _ in got] == [(t, rk) for t, _, rk, _ in want]
            assert all(abs(a[1] - b[1]) < 1e-4 for a, b in zip(got, want))
            assert all(len(a[3]) == 2 for a in got)
    for _ in range(10):  # one-token answers: the Decode stream may end before the reply
        _, _, _, msgs = generate(r.stub, g, ids=list(range(30, 70)), max_tokens=1,
                                 ignore_eos=True, **sp)
        assert len(prompt_logprobs(msgs)) == 39
    assert remote_prefills(d) == 12 and local_prefills(d) == 2
    wait_idle(pb, [d, p])


def test_router_counts_remote_prefills(cl, pb):
    d, p = cl.decode(), cl.prefill()
    r = cl.router("--decode-workers", d.addr, "--prefill-workers", p.addr,
                  "--local-prefill-threshold", "8", *FAST)
    wait_usable(r, 1, 1)
    for i in range(20):
        run(r, pb, [(i + j) % 300 + 1 for j in range(40)], 1)
    assert metric(p.metrics(), "chunkserve:prefill_requests_total") == 20
    assert remote_prefills(d) == 20
    assert metric(r.metrics(), "chunkserve:prefills_total", 'path="remote"') == 20


def hold_pages(pb, p, n_tokens, transfer_id):
    """Reserves n_tokens' pages on decode worker p as another router replica would: a
    Worker/Decode call for a remote prefill that never comes (its lease is long).  Returns
    the open call (cancel it to free the pages) once the worker admitted it."""
    c, g = pb.cluster_pb2, pb.generation_pb2
    ch = grpc.insecure_channel(p.addr)
    call = pb.cluster_pb2_grpc.WorkerStub(ch).Decode(c.DecodeRequest(
        request_id=f"hold-{transfer_id}", transfer_id=transfer_id, token_ids=[7] * n_tokens,
        num_prompt_tokens=n_tokens, sampling=g.SamplingParams(max_tokens=1), local_prefill=False,
        lease_ms=600000), timeout=300)
    first = next(call)
    assert first.WhichOneof("event") == "admitted", first
    call.channel = ch
    return call


def test_worker_refusal_names_the_field(cl, pb):
    """A worker refuses a bad Worker/Decode call (INVALID_ARGUMENT) with the field in the
    chunkserve-field trailer, as the public doors do; the router relays it (legs.c)."""
    a = cl.decode()
    c, g = pb.cluster_pb2, pb.generation_pb2
    ch = grpc.insecure_channel(a.addr)
    stub = pb.cluster_pb2_grpc.WorkerStub(ch)
    for fields, field in [(dict(sampling=g.SamplingParams(top_p=1.5)), "sampling.top_p"),
                          (dict(token_ids=[5, 349]), "token_ids"),
                          (dict(token_ids=[5] * TINY_CTX), "context")]:
        kw = dict(request_id="bad", transfer_id=1, token_ids=[5, 6], num_prompt_tokens=1,
                  local_prefill=True)
        kw.update(fields)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Decode(c.DecodeRequest(**kw), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert dict(e.value.trailing_metadata() or ()).get("chunkserve-field") == field
    ch.close()


def test_refusal_goes_to_the_next_worker_then_resource_exhausted(cl, pb, reference):
    """Decode workers with tiny pools.  Another replica's reservation (hold_pages) fills a
    worker the router still believes empty (its status interval is a minute): the worker
    refuses (RESOURCE_EXHAUSTED before admitting), the router tries the next one; that is
    not a failure.  When every worker refuses, the client gets RESOURCE_EXHAUSTED at the
    queue timeout; once the pages are free again, requests are served."""
    a = cl.decode(mib=2)  # preferred: the most free pages
    b = cl.decode(mib=1)
    sa, sb = worker_status(pb, a), worker_status(pb, b)
    assert sa.kv_pages_total > sb.kv_pages_total
    r = cl.router("--decode-workers", f"{a.addr},{b.addr}", "--status-interval-ms", "60000",
                  "--queue-timeout-ms", "1500", "--log-level", "debug")
    wait_usable(r, 2)  # the first poll is at once; the next one a minute later
    ps = sa.page_size
    hold_a = hold_pages(pb, a, (sa.kv_pages_total - 2) * ps, 11)
    prompt = [i % 300 + 1 for i in range(5 * ps)]  # 5 pages: more than a has left
    assert worker_status(pb, a).kv_pages_free < 5 <= worker_status(pb, b).kv_pages_free
    ids, text, _ = run(r, pb, prompt, 5)
    assert (ids, text) == reference(prompt, 5)
    assert placed_on(r, a.addr) == 1 and placed_on(r, b.addr) == 1
    assert f"decode worker {a.addr} refused" in r.stderr()
    assert metric(r.metrics(), "chunkserve:retries_total") == 0  # a refusal is not a failure
    # every worker full: RESOURCE_EXHAUSTED after the queue timeout (not a hang)
    hold_b = hold_pages(pb, b, (sb.kv_pages_total - 2) * sb.page_size, 12)
    with pytest.raises(grpc.RpcError) as e:
        run(r, pb, prompt, 5, timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert "no decode worker had room" in e.value.details()
    assert f"decode worker {b.addr} refused" in r.stderr()
    # room again: served
    hold_a.cancel()
    hold_b.cancel()
    wait_idle(pb, [a, b])
    ids, text, _ = run(r, pb, prompt, 5)
    assert (ids, text) == reference(prompt, 5)
    assert metric(r.metrics(), "chunkserve:retries_total") == 0
    hold_a.channel.close()
    hold_b.channel.close()


def test_a_short_prompt_is_not_held_behind_one_waiting_for_room(cl, pb, reference):
    """A long prompt waits in the router's queue for KV room (its worker refused it); a short
    one that fits arrives: it is placed at once, not parked behind the long one until the
    queue's next run (a status, or the 250 ms safety net). Nothing else runs, and the status
    interval is a minute, so no run of the queue is due when it arrives."""
    a = cl.decode(mib=2)
    sa = worker_status(pb, a)
    r = cl.router("--decode-workers", a.addr, "--status-interval-ms", "60000",
                  "--queue-timeout-ms", "20000", "--log-level", "debug")
    wait_usable(r, 1)
    ps = sa.page_size
    hold = hold_pages(pb, a, (sa.kv_pages_total - 2) * ps, 21)
    long_prompt = [i % 300 + 1 for i in range(5 * ps)]  # 5 pages: more than a has left
    waiting = r.stub.Generate(gen(pb, long_prompt, 4), timeout=60)
    wait_for(lambda: f"decode worker {a.addr} refused" in r.stderr(), 30,
             "the worker to refuse the long prompt")
    wait_for(lambda: metric(r.metrics(), "chunkserve:num_requests_waiting") == 1, 30,
             "the long prompt to wait in the router's queue")
    short = [i % 300 + 1 for i in range(ps - 4)]  # one page
    msgs = list(r.stub.Generate(gen(pb, short, 3), timeout=60))
    assert [t for m in msgs for t in m.token_ids] == reference(short, 3)[0]
    rid = msgs[0].request_id
    assert rid and f"request {rid}: decode on {a.addr}" in r.stderr()
    assert f"request {rid}: waits" not in r.stderr(), "parked behind the long prompt"
    assert metric(r.metrics(), "chunkserve:num_requests_waiting") == 1  # still there
    waiting.cancel()
    hold.cancel()
    hold.channel.close()
    wait_for(lambda: metric(r.metrics(), "chunkserve:num_requests_waiting") == 0, 30,
             "the cancelled one to leave the queue")


def test_worker_too_small_is_skipped(cl, pb, reference):
    small, big = cl.decode(mib=1), cl.decode(mib=16)
    ss, sb = worker_status(pb, small), worker_status(pb, big)
    prompt = [i % 300 + 1 for i in range(3000)]
    assert ss.kv_pages_total * ss.page_size < len(prompt) < sb.kv_pages_total * sb.page_size
    r = cl.router("--decode-workers", f"{small.addr},{big.addr}", *FAST)
    wait_usable(r, 2)
    for _ in range(2):  # whichever the round robin starts with
        ids, text, _ = run(r, pb, prompt, 3)
        assert (ids, text) == reference(prompt, 3)
    assert local_prefills(small) + remote_prefills(small) == 0
    assert local_prefills(big) == 2
    assert metric(r.metrics(), "chunkserve:retries_total") == 0


def test_retry_before_tokens(cl, pb, reference):
    """A worker dies (kill -9) while the request waits for its admission there: retried on
    another worker before any token, not migrated."""
    a = cl.decode(mib=32)  # preferred: the most free pages
    b = cl.decode()
    r = cl.router("--decode-workers", f"{a.addr},{b.addr}", *SLOW_STATUS)
    wait_usable(r, 2)
    a.pause()  # the Decode call waits there, unanswered
    prompt = [5, 6]
    it = r.stub.Generate(gen(pb, prompt, 6), timeout=120)
    wait_placed(r, a, [b], "retry before tokens")
    a.kill9()
    ids = rest(it, [])
    assert ids == reference(prompt, 6)[0]
    m = r.metrics()
    assert metric(m, "chunkserve:retries_total") == 1
    assert metric(m, "chunkserve:migrations_total") == 0
    assert placed_on(r, b.addr) == 1 and local_prefills(b) == 1
    assert "retrying (1/3)" in r.stderr()
    wait_idle(pb, [b])


SAMPLED = dict(temperature=0.8, top_p=0.95, seed=1234)


def test_migration_continues_without_duplicates(cl, pb, reference):
    """kill -9 of the decode worker mid-stream: the stream continues on another worker from
    prompt + the tokens relayed so far, exactly as the uninterrupted run.  The stream is
    sampled (seeded): the new worker continues from the latest RNG state the router saw."""
    a = cl.decode(mib=32)  # preferred
    b = cl.decode()
    r = cl.router("--decode-workers", f"{a.addr},{b.addr}", *FAST)
    wait_usable(r, 2)
    prompt = LONG_PROMPT
    want, want_text = reference(prompt, LONG, **SAMPLED)
    assert want != reference(prompt, LONG)[0]  # sampled, not greedy
    it = r.stub.Generate(gen(pb, prompt, LONG, **SAMPLED), timeout=300)
    msgs = [next(it)]
    a.kill9()
    msgs += list(it)
    ids = [t for m in msgs for t in m.token_ids]
    assert len(ids) == LONG, "duplicated or missing tokens"
    assert ids == want and "".join(m.text for m in msgs) == want_text
    assert (msgs[-1].usage.prompt_tokens, msgs[-1].usage.completion_tokens) == (len(prompt), LONG)
    assert msgs[0].request_id and all(not m.request_id for m in msgs[1:])
    m = r.metrics()
    assert metric(m, "chunkserve:migrations_total") == 1
    assert metric(m, "chunkserve:retries_total") == 0
    assert local_prefills(b) == 1
    # b prefilled prompt + the k tokens a had streamed, then generated the rest
    bm = b.metrics()
    k = metric(bm, "chunkserve:prompt_tokens_total") - len(prompt)
    assert 0 < k < LONG and metric(bm, "chunkserve:generation_tokens_total") == LONG - k
    wait_idle(pb, [b])


def test_hung_worker_is_failed_over(cl, pb, reference):
    """A decode worker that stops answering mid-stream (SIGSTOP: its connections stay open)
    is declared down after a few seconds without a status, and its streams migrate.  Once
    it runs again it frees everything of the stream it lost."""
    a = cl.decode(mib=32)  # preferred
    b = cl.decode()
    r = cl.router("--decode-workers", f"{a.addr},{b.addr}", *FAST)
    wait_usable(r, 2)
    prompt = LONG_PROMPT
    want, _ = reference(prompt, LONG)
    it = r.stub.Generate(gen(pb, prompt, LONG), timeout=300)
    ids = list(next(it).token_ids)
    a.pause()
    ids = rest(it, ids)
    assert ids == want
    assert metric(r.metrics(), "chunkserve:migrations_total") == 1
    assert "has not answered a status poll" in r.stderr()
    a.resume()
    wait_idle(pb, [a, b])
    wait_usable(r, 2)  # a is used again


def test_admission_is_bounded_by_the_lease(cl, pb, reference):
    """A worker that does not admit within --lease-ms (stopped before the call) is given up
    for the next one."""
    a = cl.decode(mib=32)  # preferred
    b = cl.decode()
    r = cl.router("--decode-workers", f"{a.addr},{b.addr}", "--lease-ms", "700", *SLOW_STATUS)
    wait_usable(r, 2)
    a.pause()
    prompt = [8, 9]
    it = r.stub.Generate(gen(pb, prompt, 3), timeout=120)
    wait_placed(r, a, [b], "admission bounded by the lease")
    ids = rest(it, [])
    assert ids == reference(prompt, 3)[0]
    assert "not admitted within --lease-ms" in r.stderr()
    assert metric(r.metrics(), "chunkserve:retries_total") == 1
    assert placed_on(r, b.addr) == 1
    a.resume()  # it sees the call, already cancelled: nothing stays reserved
    wait_idle(pb, [a, b])


def test_migration_to_remote_prefill_by_context_length(cl, pb, reference):
    """A short prompt is prefilled locally; after a migration its context (prompt + the
    tokens relayed) is above the threshold: prefilled on the prefill worker."""
    a = cl.decode(mib=32)  # preferred
    b = cl.decode()
    p = cl.prefill()
    r = cl.router("--decode-workers", f"{a.addr},{b.addr}", "--prefill-workers", p.addr,
                  "--local-prefill-threshold", "4", *FAST)
    wait_usable(r, 2, 1)
    prompt = LONG_PROMPT  # under the threshold
    want, _ = reference(prompt, LONG)
    it = r.stub.Generate(gen(pb, prompt, LONG), timeout=300)
    first = next(it)
    assert local_prefills(a) == 1 and remote_prefills(a) == 0
    a.kill9()
    ids = rest(it, first.token_ids)
    assert ids == want
    assert remote_prefills(b) == 1 and local_prefills(b) == 0
    assert metric(p.metrics(), "chunkserve:prefill_requests_total") == 1
    wait_metric(p, "chunkserve:kv_transfers_completed_total", "", 1)
    assert metric(b.metrics(), "chunkserve:kv_transfers_completed_total") == 1
    # the prefill worker got prompt + the relayed tokens (at least the first message's)
    n = int(re.search(r"\): (\d+) tokens", log_line(p, first.request_id)).group(1))
    assert len(prompt) + len(first.token_ids) <= n < len(prompt) + LONG
    m = r.metrics()
    assert metric(m, "chunkserve:migrations_total") == 1
    assert metric(m, "chunkserve:prefills_total", 'path="local"') == 1
    assert metric(m, "chunkserve:prefills_total", 'path="remote"') == 1
    wait_idle(pb, [b, p])


def test_prefill_failure_retries_and_cancels_decode(cl, pb, reference):
    """Prefill workers killed (-9) while prefilling: each failure is a retry (the decode
    worker's reservation for it is cancelled); with no prefill worker left the prompt is
    prefilled locally."""
    d = cl.decode()
    p1, p2 = cl.prefill(), cl.prefill()
    r = cl.router("--decode-workers", d.addr, "--prefill-workers", f"{p1.addr},{p2.addr}",
                  "--local-prefill-threshold", "4", *SLOW_STATUS)
    wait_usable(r, 1, 2)
    p1.pause()
    p2.pause()
    prompt = list(range(30, 50))
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(run, r, pb, prompt, 4)
        killed = []
        t_end = time.monotonic() + 60
        while not fut.done() and time.monotonic() < t_end:
            for p in (p1, p2):
                if p not in killed and prefilled_on(r, p.addr):
                    p.kill9()  # the Prefill call there fails at once
                    killed.append(p)
            time.sleep(0.05)
        ids, text, _ = fut.result(timeout=120)
    assert (ids, text) == reference(prompt, 4)
    assert killed, "no prefill worker was ever asked"
    assert metric(r.metrics(), "chunkserve:retries_total") == len(killed)
    # one remote attempt per prefill worker killed, then the local one
    assert remote_prefills(d) == len(killed) and local_prefills(d) == 1
    wait_idle(pb, [d])
    assert metric(d.metrics(), "chunkserve:kv_transfers_completed_total") == 0
    wait_for(lambda: d.metric("chunkserve:kv_transfers_failed_total") == len(killed), 30,
             "the decode worker to end the reservations of the failed attempts")


def test_hung_prefill_worker_is_failed_over(cl, pb, reference):
    """A prefill worker that stops (SIGSTOP) during a prefill is declared down; the request
    is retried (here: prefilled locally).  Once it runs again, its late prefill of the
    cancelled transfer changes nothing on the decode worker."""
    d = cl.decode()
    p = cl.prefill()
    r = cl.router("--decode-workers", d.addr, "--prefill-workers", p.addr,
                  "--local-prefill-threshold", "4", *SLOW_STATUS)
    wait_usable(r, 1, 1)
    p.pause()
    prompt = list(range(60, 90))
    ids, text, _ = run(r, pb, prompt, 4)
    assert (ids, text) == reference(prompt, 4)
    assert prefilled_on(r, p.addr) == 1, "the request was not sent to the stopped worker"
    assert "has not answered a status poll" in r.stderr()
    assert metric(r.metrics(), "chunkserve:retries_total") == 1
    assert remote_prefills(d) == 1 and local_prefills(d) == 1
    p.resume()
    wait_idle(pb, [d, p])
    wait_usable(r, 1, 1)
    ids, text, _ = run(r, pb, prompt, 4)  # and it serves again
    assert (ids, text) == reference(prompt, 4)
    assert prefilled_on(r, p.addr) == 2
    assert metric(d.metrics(), "chunkserve:kv_transfers_completed_total") == 1


def test_max_retries_then_unavailable(cl, pb):
    """Three stopped decode workers, --max-retries 2: three attempts, each given up at the
    lease, then UNAVAILABLE; each worker was tried once."""
    ws = [cl.decode() for _ in range(3)]
    r = cl.router("--decode-workers", ",".join(w.addr for w in ws), "--max-retries", "2",
                  "--lease-ms", "300", *SLOW_STATUS)
    wait_usable(r, 3)
    for w in ws:
        w.pause()
    with pytest.raises(grpc.RpcError) as e:
        run(r, pb, [1, 2], 3, timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "3 attempts failed" in e.value.details()
    assert [placed_on(r, w.addr) for w in ws] == [1, 1, 1], r.stderr()[-3000:]
    for w in ws:
        w.resume()
    wait_idle(pb, ws)


def test_client_cancel_reaches_the_worker(cl, pb):
    d = cl.decode()
    r = cl.router("--decode-workers", d.addr, *FAST)
    wait_usable(r, 1)
    it = r.stub.Generate(gen(pb, [4, 5, 6], LONG), timeout=300)
    rid = next(it).request_id
    it.cancel()
    wait_for(lambda: metric(r.metrics(), "chunkserve:requests_total", 'code="CANCELLED"') == 1, 30,
             "the router to count the cancelled request")
    wait_idle(pb, [d])  # every page free again
    log_line(d, rid, ", local prefill): cancelled")
    assert d.metric("chunkserve:generation_tokens_total") < LONG
    assert metric(r.metrics(), "chunkserve:num_requests_running") == 0


def test_client_deadline_reaches_the_worker(cl, pb):
    """The client's deadline passes while the worker is stopped mid-stream: the client gets
    DEADLINE_EXCEEDED and, once the worker runs again, it ends the request and frees it."""
    d = cl.decode()
    r = cl.router("--decode-workers", d.addr, "--status-interval-ms", "1000")
    wait_usable(r, 1)
    it = r.stub.Generate(gen(pb, [4, 5, 6], LONG), timeout=2.0)
    rid = None
    with pytest.raises(grpc.RpcError) as e:
        rid = next(it).request_id
        d.pause()  # no more tokens: the deadline passes (long before the 5 s down detection)
        list(it)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    d.resume()
    wait_idle(pb, [d])
    # DEADLINE_EXCEEDED, or CANCELLED when the client's own timer ended the call first
    wait_for(lambda: sum(metric(r.metrics(), "chunkserve:requests_total", f'code="{c}"')
                         for c in ("DEADLINE_EXCEEDED", "CANCELLED")) == 1,
             30, "the router to count the request")
    if rid:
        log_line(d, rid, ", local prefill): cancelled")
    assert metric(r.metrics(), "chunkserve:migrations_total") == 0


def test_overload_is_refused_at_once(cl, pb, reference):
    """--max-inflight 1, --max-queue 1: with one request placed and one waiting, a third is
    refused RESOURCE_EXHAUSTED at once (not at the queue timeout); the waiting one gets the
    slot when the first ends."""
    d = cl.decode()
    r = cl.router("--decode-workers", d.addr, "--max-inflight", "1", "--max-queue", "1",
                  "--queue-timeout-ms", "30000", "--status-interval-ms", "1000")
    wait_usable(r, 1)
    first = r.stub.Generate(gen(pb, [1, 2], LONG), timeout=300)
    next(first)  # placed and streaming
    d.pause()  # ... and stays so while we look
    second = r.stub.Generate(gen(pb, [1, 2], 2), timeout=300)  # waits for the slot
    wait_for(lambda: metric(r.metrics(), "chunkserve:num_requests_waiting") == 1, 30,
             "the second request to wait")
    assert metric(r.metrics(), "chunkserve:num_requests_running") == 1
    with pytest.raises(grpc.RpcError) as e:  # well before the 30 s queue timeout
        run(r, pb, [1, 2], 2, timeout=20)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert "--max-queue" in e.value.details()
    d.resume()
    first.cancel()
    assert rest(second, []) == reference([1, 2], 2)[0]  # got the slot once the first ended
    m = r.metrics()
    assert metric(m, "chunkserve:requests_total", 'code="RESOURCE_EXHAUSTED"') == 1
    assert metric(m, "chunkserve:requests_total", 'code="OK"') == 1
    wait_idle(pb, [d])


def test_burst_through_a_small_window(pb, reference, worker_bins, tiny_model):
    """64 concurrent requests through --max-inflight 4 over two decode workers (the harness's
    Cluster): all complete, exact; both workers used; the gauges are back to 0."""
    prompts = [[i % 300 + 1, 5, 6] for i in range(64)]
    wants = [reference(p, 8)[0] for p in prompts]
    c = Cluster(worker_bins, tiny_model, pb, n_prefill=0, n_decode=2, kv_cache_mib=16,
                router_args=["--max-inflight=4", "--queue-timeout-ms=120000"])
    try:
        g = pb.generation_pb2

        def one(p):
            return generate(c.stub, g, ids=p, max_tokens=8, timeout=300, ignore_eos=True)[0]

        with ThreadPoolExecutor(64) as ex:
            got = list(ex.map(one, prompts))
        assert got == wants
        served = [local_prefills(w) for w in c.decode]
        assert sum(served) == 64 and all(served), served
        m = c.router.metrics()
        assert metric(m, "chunkserve:requests_total", 'code="OK"') == 64
        assert metric(m, "chunkserve:num_requests_running") == 0
        assert metric(m, "chunkserve:num_requests_waiting") == 0
        c.wait_idle()
    finally:
        c.stop()


def test_sigterm_with_streams(cl, pb, reference):
    """SIGTERM: a short stream finishes within the grace period; a long one (its worker
    stopped, so it cannot finish) ends UNAVAILABLE after it, its worker call cancelled; new
    calls are refused; the router exits 0."""
    d = cl.decode()
    r = cl.router("--decode-workers", d.addr, "--grace-ms", "600", "--status-interval-ms", "1000")
    wait_usable(r, 1)
    long = r.stub.Generate(gen(pb, [3, 4], LONG), timeout=300)
    long_id = next(long).request_id
    short = r.stub.Generate(gen(pb, [1, 2], 10), timeout=300)
    first = next(short)
    r.proc.send_signal(signal.SIGTERM)
    # New calls are refused while draining. Asked while the long stream still holds the
    # router up (not after the grace, when a call can meet the server shutting down and
    # end CANCELLED instead).
    wait_for(lambda: readyz(r) == 503, 30, "the router to drain")
    with pytest.raises(grpc.RpcError) as e:
        run(r, pb, [1, 2], 2, timeout=20)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert rest(short, first.token_ids) == reference([1, 2], 10)[0]
    d.pause()
    with pytest.raises(grpc.RpcError) as e:
        list(long)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert r.proc.wait(timeout=30) == 0
    d.resume()
    wait_idle(pb, [d])
    log_line(d, first.request_id, ", local prefill): length, 2 + 10 tokens")
    log_line(d, long_id, ", local prefill): cancelled")  # its worker call was cancelled


def test_dns_discovery_and_readiness(cl, pb, reference):
    d = cl.decode()
    r = cl.router("--decode-dns", f"localhost:{d.port}", "--dns-refresh-ms", "200", *FAST)
    wait_for(lambda: readyz(r) == 200, 30, "the router to be ready")
    ids, text, _ = run(r, pb, [7, 7], 3)
    assert (ids, text) == reference([7, 7], 3)
    assert local_prefills(d) == 1
    assert "dns localhost" in r.stderr()


def test_worker_of_another_role_is_not_used(cl, pb):
    """A prefill worker listed as a decode worker and a decode worker listed as a prefill
    worker: neither is used."""
    p, d = cl.prefill(), cl.decode()
    r = cl.router("--decode-workers", p.addr, "--prefill-workers", d.addr,
                  "--local-prefill-threshold", "1", *FAST)
    wait_for(lambda: "not a decode worker" in r.stderr() and "not a prefill worker" in r.stderr(),
             30, "the router to see both workers' statuses")
    assert readyz(r) == 503
    assert usable(r, "decode") == 0 and usable(r, "prefill") == 0
    with pytest.raises(grpc.RpcError) as e:
        run(r, pb, [1], 2, timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert metric(p.metrics(), "chunkserve:prefill_requests_total") == 0
    assert local_prefills(d) + remote_prefills(d) == 0


@pytest.fixture(scope="module")
def qwen2_model(worker_bins, tmp_path_factory):
    return make_tiny(worker_bins, tmp_path_factory.mktemp("qwen2"), "--qwen2")


def test_worker_of_another_model_is_not_used(cl, pb, qwen2_model):
    """A decode worker serving another model (the qwen2 tiny variant) is never usable."""
    q = cl.decode(model=qwen2_model)
    r = cl.router("--decode-workers", q.addr, *FAST)
    t_end = time.monotonic() + 3  # some 30 status polls
    while time.monotonic() < t_end:
        assert readyz(r) == 503 and usable(r, "decode") == 0
        time.sleep(0.1)
    with pytest.raises(grpc.RpcError) as e:
        run(r, pb, [1], 2, timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert local_prefills(q) == 0


def test_prefill_worker_too_small_is_skipped(cl, pb, reference):
    d = cl.decode()
    p = cl.prefill(mib=1)
    sp = worker_status(pb, p)
    prompt = [i % 300 + 1 for i in range(3000)]
    assert sp.kv_pages_total * sp.page_size < len(prompt)
    r = cl.router("--decode-workers", d.addr, "--prefill-workers", p.addr,
                  "--local-prefill-threshold", "8", *FAST)
    wait_usable(r, 1, 1)
    ids, text, _ = run(r, pb, prompt, 3)
    assert (ids, text) == reference(prompt, 3)


def test_worker_restart_and_death(cl, pb, reference):
    """A worker that dies (kill -9) stops being used (UNAVAILABLE after the no-worker wait);
    the same worker started again on the same port is used again, and the restart is
    logged."""
    d = cl.decode()
    r = cl.router("--decode-workers", d.addr, *FAST)
    wait_usable(r, 1)
    d.kill9()
    wait_for(lambda: readyz(r) == 503, 30, "the router to see the worker gone")
    with pytest.raises(grpc.RpcError) as e:
        run(r, pb, [1], 2, timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    d.start(port=d.port)  # a new process: its counters start at 0
    wait_for(lambda: readyz(r) == 200, 60, "the router to use the restarted worker")
    ids, text, _ = run(r, pb, [1], 2)
    assert (ids, text) == reference([1], 2)
    assert local_prefills(d) == 1
    assert "restarted" in r.stderr()


def test_decode_worker_drains_on_sigterm(cl, pb, reference):
    """Scale-in (Kubernetes sends SIGTERM): the decode worker goes unready and shows
    chunkserve:draining 1, keeps answering status polls (so the router leaves its stream
    there: no migration), refuses new calls (they go to the other worker), finishes its
    stream exactly, logs the drain and exits 0 long before its grace period ends."""
    a = cl.decode("--grace-ms=60000", mib=32)  # preferred: more free pages
    b = cl.decode()
    r = cl.router("--decode-workers", f"{a.addr},{b.addr}", "--log-level", "debug", *FAST[:2])
    wait_usable(r, 2)
    it = r.stub.Generate(gen(pb, LONG_PROMPT, LONG), timeout=300)
    msgs = [next(it)]
    assert placed_on(r, a.addr) == 1
    a.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: a.metric("chunkserve:draining") == 1, 10, "a to show draining")
    with urllib.request.urlopen(a.http + "/healthz", timeout=5) as h:
        assert h.status == 200
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(a.http + "/readyz", timeout=5)
    assert e.value.code == 503
    wait_usable(r, 1)
    assert run(r, pb, [5, 6], 4)[:2] == reference([5, 6], 4)  # placed on b
    assert placed_on(r, b.addr) == 1
    msgs += list(it)
    ids = [t for m in msgs for t in m.token_ids]
    assert ids == reference(LONG_PROMPT, LONG)[0], "duplicated, missing or wrong tokens"
    assert a.proc.wait(timeout=30) == 0
    assert "calls ended by the grace period" in a.stderr()
    assert re.search(r"drained in [0-9.]+ s \(0 calls ended by the grace period\)", a.stderr())
    m = r.metrics()
    assert metric(m, "chunkserve:migrations_total") == 0
    assert metric(m, "chunkserve:retries_total") == 0
    wait_idle(pb, [b])


def test_decode_worker_grace_over_migrates(cl, pb, reference):
    """A stream longer than the worker's grace period: at its end the worker ends the call
    UNAVAILABLE and the router migrates the stream to the other worker, exactly."""
    a = cl.decode("--grace-ms=300", mib=32)
    b = cl.decode()
    r = cl.router("--decode-workers", f"{a.addr},{b.addr}", "--log-level", "debug", *FAST[:2])
    wait_usable(r, 2)
    it = r.stub.Generate(gen(pb, LONG_PROMPT, LONG), timeout=300)
    msgs = [next(it)]
    assert placed_on(r, a.addr) == 1
    a.proc.send_signal(signal.SIGTERM)
    msgs += list(it)
    ids = [t for m in msgs for t in m.token_ids]
    assert ids == reference(LONG_PROMPT, LONG)[0], "duplicated, missing or wrong tokens"
    assert a.proc.wait(timeout=30) == 0
    assert re.search(r"drained in [0-9.]+ s \(1 calls ended by the grace period\)", a.stderr())
    assert metric(r.metrics(), "chunkserve:migrations_total") == 1
    wait_idle(pb, [b])


def test_two_prefill_workers_share_a_decode_worker(cl, pb, reference):
    """A scaled-out prefill pool: two prefill workers stream KV to one decode worker at once.
    Their KV channels carry distinct sender names (a shared default name made the decode
    worker fence one out: "stale incarnation"), so no transfer fails and nothing retries."""
    d = cl.decode(mib=32)
    p1, p2 = cl.prefill(), cl.prefill()
    r = cl.router("--decode-workers", d.addr, "--prefill-workers", f"{p1.addr},{p2.addr}",
                  "--local-prefill-threshold", "4", *FAST)
    wait_usable(r, 1, 2)
    prompts = [list(range(40 + k, 140 + k)) for k in range(8)]
    for _ in range(3):  # until both prefill workers have served (placement by queued tokens)
        with ThreadPoolExecutor(len(prompts)) as ex:
            outs = list(ex.map(lambda pr: run(r, pb, pr, 3)[:2], prompts))
        assert outs == [reference(pr, 3) for pr in prompts]
        if min(p.metric("chunkserve:prefill_requests_total") for p in (p1, p2)) > 0:
            break
    assert min(p.metric("chunkserve:prefill_requests_total") for p in (p1, p2)) > 0
    assert metric(r.metrics(), "chunkserve:retries_total") == 0
    assert d.metric("chunkserve:kv_transfers_failed_total") == 0
    assert "stale incarnation" not in d.stderr() and "reconnected" not in d.stderr()
    wait_idle(pb, [d])


def test_prefill_worker_of_another_kv_layout_is_not_paired(cl, pb, reference):
    """A prefill worker whose KV pages have another layout (here: another page size) than the
    decode worker's is never paired with it (GetStatus reports the layout fingerprint): the
    prompt is prefilled on the decode worker at once, with no failed transfer and no retry."""
    d = cl.decode()
    p = cl.prefill("--page-size=8")
    r = cl.router("--decode-workers", d.addr, "--prefill-workers", p.addr,
                  "--local-prefill-threshold", "4", *FAST)
    wait_usable(r, 1, 1)
    assert worker_status(pb, p).kv_layout_fingerprint != worker_status(pb, d).kv_layout_fingerprint
    prompt = list(range(60, 100))
    assert run(r, pb, prompt, 3)[:2] == reference(prompt, 3)
    assert metric(r.metrics(), "chunkserve:retries_total") == 0
    assert p.metric("chunkserve:prefill_requests_total") == 0
    assert local_prefills(d) == 1 and remote_prefills(d) == 0
    assert d.metric("chunkserve:kv_transfers_failed_total") == 0


# The process shell's own series (proc/src/proc.c), in every process with a cluster secret.
SHELL_SERIES = {"chunkserve:draining", "chunkserve:cluster_secret_key_id",
                "chunkserve:cluster_secret_keys", "chunkserve:cluster_secret_reloads_total",
                "chunkserve:cluster_secret_reload_errors_total"}


def test_metrics_tables_match_what_is_exported(cl, worker_bins):
    """--metrics-json prints each process's metrics table (the twin of --help-json): every
    series it declares is in the live /metrics and every series exported is declared (the
    process shell's own series aside: chunkserve:draining and the cluster secret's)."""
    d, p = cl.decode(), cl.prefill()
    r = cl.router("--decode-workers", d.addr)
    for proc, exe in ((d, "chunkserve-decode"), (p, "chunkserve-prefill"), (r, "chunkserve-router")):
        table = json.loads(subprocess.run([str(worker_bins / exe), "--metrics-json"], check=True,
                                          capture_output=True, text=True).stdout)
        declared = {t["name"] + ("{" + t["labels"] + "}" if t["labels"] else "") for t in table}
        live = exported_series(proc.metrics())
        assert declared - live == set(), (exe, declared - live)
        assert live - declared == SHELL_SERIES, (exe, live - declared)


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_quantized_cluster_equals_one_process(pb, worker_bins, tmp_path, kv):
    """A Q4_1 model (quant mode: the integer kernels) in a 1 prefill + 1 decode cluster, with
    fp32 or bf16 KV pages: greedy and seeded tokens equal `chunkserve serve` on the same model
    and flags, prompts go remote and every transfer completes (GetStatus says quant and the
    dtype)."""
    model = make_tiny(worker_bins, tmp_path / "q4_1", "--type", "q4_1")
    flags = ["--kv-bf16"] if kv == "bf16" else []
    ref = Reference(worker_bins / "chunkserve", model, pb, *flags)
    # each prompt is sent twice: load-only placement, so the second does not prefill
    # locally on the decode worker that already holds its pages (prefix-aware routing)
    c = Cluster(worker_bins, model, pb, n_prefill=1, n_decode=1, kv_cache_mib=16,
                worker_args=flags,
                router_args=["--local-prefill-threshold=8", "--prefix-routing=false"])
    try:
        (p,), (d,) = c.prefill, c.decode
        sp, sd = c.status(p), c.status(d)
        assert sp.weight_mode == sd.weight_mode == "quant"
        want_dtype = pb.cluster_pb2.KV_DTYPE_BF16 if kv == "bf16" else pb.cluster_pb2.KV_DTYPE_F32
        assert sp.kv_dtype == sd.kv_dtype == want_dtype
        assert metric(p.metrics(), "chunkserve:weight_mode", 'mode="quant"') == 1
        g = pb.generation_pb2
        prompts = [list(range(20, 60)), [(i * 7) % 300 + 3 for i in range(150)]]
        for prompt in prompts:
            assert generate(c.stub, g, ids=prompt, max_tokens=12, ignore_eos=True)[:2] == \
                ref(prompt, 12)
            assert generate(c.stub, g, ids=prompt, max_tokens=12, ignore_eos=True,
                            temperature=0.8, seed=7)[:2] == ref(prompt, 12, temperature=0.8, seed=7)
        wait_metric(d, "chunkserve:kv_transfers_completed_total", "", 4)
        assert metric(d.metrics(), "chunkserve:prefills_total", 'path="remote"') == 4
        assert metric(d.metrics(), "chunkserve:kv_transfers_failed_total") == 0
        c.wait_idle()
    finally:
        c.stop()
        ref.stop()


def test_local_prefills_on_decode_workers_hit_their_prefix_cache(cl, pb):
    """Six identical 304-token prompts prefilled locally by two decode workers (issue 20's
    first finding): from each worker's second one on, 288 tokens (18 full pages) come from
    its prefix cache, and the client's usage says so even when the first generated token is
    also the last (max_tokens 1). Before: the reserved local prefill never looked at the
    cache, and the count came only from non-final tokens."""
    ds = [cl.decode(mib=32), cl.decode(mib=32)]
    r = cl.router("--decode-workers", ",".join(d.addr for d in ds), *FAST)
    wait_usable(r, 2)
    prompt = [(17 * j) % 300 + 1 for j in range(304)]
    cached = []
    for _ in range(6):
        _, _, msgs = run(r, pb, prompt, 1)
        cached.append(msgs[-1].usage.cached_prompt_tokens)
    hits = sum(d.metric("chunkserve:prefix_cache_hit_tokens_total") for d in ds)
    used = sum(1 for d in ds if local_prefills(d) > 0)
    assert sum(local_prefills(d) for d in ds) == 6
    assert hits == (6 - used) * 288, (hits, used, cached)
    assert sorted(cached) == [0] * used + [288] * (6 - used)


FAULT_OK = {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED}


def fault_cluster(cl, pb, reference):
    d = cl.decode()
    p = cl.prefill()
    r = cl.router(f"--decode-workers={d.addr}", f"--prefill-workers={p.addr}",
                  "--local-prefill-threshold=8", *FAST, "--queue-timeout-ms", "300")
    wait_usable(r, 1, 1)
    prompt = list(range(30, 50))
    return d, p, r, prompt, reference(prompt, 4)[0]


def test_allocation_failure_walk_router(cl, pb, reference):
    """Fault-injection builds only (the ASan build: -DCS_FAULT_INJECTION=ON, fault.h): for
    N = 1, 2, ... a request carrying x-chunkserve-fault-alloc: N makes the router's Nth
    allocation from its receipt fail, until N passes every allocation of a request's life
    (validate, tokenize on the thread pool, place, the Prefill and Decode legs, relay,
    free). Each such request ends OK with the reference's tokens or with a status of the
    contract (never a hang or a crash), the next plain request succeeds, and at the end
    both workers are idle with every page free and every process exits 0 with no
    sanitizer report (LeakSanitizer included)."""
    d, p, r, prompt, want = fault_cluster(cl, pb, reference)
    codes, n, misses = {}, 0, 0

    def ended():
        return len(re.findall(r"fault injection: request \d+ ended", r.stderr()))
    while misses < 3:
        n += 1
        try:
            msgs = list(r.stub.Generate(gen(pb, prompt, 4), timeout=30,
                                        metadata=[("x-chunkserve-fault-alloc", str(n))]))
            code = grpc.StatusCode.OK
            assert [t for m in msgs for t in m.token_ids] == want, n
        except grpc.RpcError as e:
            code = e.code()
            assert code in FAULT_OK, (n, code, e.details())
            assert e.details(), n
        codes[code] = codes.get(code, 0) + 1
        if n == 1:
            time.sleep(0.5)  # its end is logged at once in a fault build
            if "fault injection" not in r.stderr():
                pytest.skip("not a fault-injection build (-DCS_FAULT_INJECTION=ON)")
        wait_for(lambda: ended() >= n, 30, f"request {n}'s end")
        last = re.findall(r"fault injection: request \d+ ended, the armed allocation ([a-z ]+)",
                          r.stderr())[-1]
        misses = misses + 1 if last.startswith("was not reached") else 0
        assert run(r, pb, prompt, 4)[0] == want, f"the request after failing allocation {n}"
    print(f"allocation-failure walk, router: {n - misses} allocations in a request's life, "
          f"statuses {dict((c.name, k) for c, k in codes.items())}")
    assert n - misses > 10
    wait_idle(pb, [d, p])


def test_allocation_failure_walk_workers(cl, pb, reference):
    """Fault-injection builds only: the walk of test_allocation_failure_walk_router in both
    workers' calls of a request (admission, the engine, the KV transfer, the answer): the
    router passes x-chunkserve-fault-alloc-worker on as x-chunkserve-fault-alloc to the
    Prefill and Decode calls, each worker failing its own Nth allocation from the call's
    admission. The same contract. CS_FAULT_WALK_FROM=N starts the walk at N; with
    CS_FAULT_TRACE=1 each failing allocation prints its stack
    (tools/symbolize_fault_traces.py reads them)."""
    d, p, r, prompt, want = fault_cluster(cl, pb, reference)
    list(r.stub.Generate(gen(pb, prompt, 4), timeout=30,
                         metadata=[("x-chunkserve-fault-alloc-worker", str(10**9))]))
    time.sleep(0.5)
    if "fault injection" not in d.stderr():
        pytest.skip("not a fault-injection build (-DCS_FAULT_INJECTION=ON)")
    codes, n, misses = {}, int(os.environ.get("CS_FAULT_WALK_FROM", "1")) - 1, 0
    try:
        while misses < 3:
            n += 1
            seen = {w.name: len(w.stderr()) for w in (d, p)}
            try:
                msgs = list(r.stub.Generate(gen(pb, prompt, 4), timeout=30,
                                            metadata=[("x-chunkserve-fault-alloc-worker", str(n))]))
                code = grpc.StatusCode.OK
                assert [t for m in msgs for t in m.token_ids] == want, n
            except grpc.RpcError as e:
                code = e.code()
                assert code in FAULT_OK, (n, code, e.details())
            codes[code] = codes.get(code, 0) + 1
            wait_idle(pb, [d, p])

            def lines():
                return [ln for w in (d, p) for ln in w.stderr()[seen[w.name]:].splitlines()
                        if "fault injection: request" in ln]
            wait_for(lambda: lines(), 10, f"the decode worker's call of request {n} to end")
            time.sleep(0.2)  # the prefill worker's, when the request got that far
            misses = 0 if any("failed in its life" in ln for ln in lines()) else misses + 1
            assert run(r, pb, prompt, 4)[0] == want, f"the request after failing allocation {n}"
    except BaseException:  # the logs say where: CS_FAULT_TRACE=1 adds each failure's stack
        for w in (d, p, r):
            print(f"--- {w.name}, walk at {n} ---\n{w.stderr()[-8000:]}")
        raise
    print(f"allocation-failure walk, workers: {n - misses} allocations in a call's life, "
          f"statuses {dict((c.name, k) for c, k in codes.items())}")
    assert n - misses > 10
    wait_idle(pb, [d, p])
