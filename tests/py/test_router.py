"""`chunkserve-router` against real gRPC clients (grpcio stubs generated from proto/).

Two parts:
- the router alone, with no worker at all: input validation without workers, the unary
  calls it answers itself, a prompt UNAVAILABLE (no hang) when no worker exists, its HTTP
  endpoints, SIGTERM;
- the router in front of fake workers: chunkserve.v1.Worker servers written here in
  Python (grpcio) that follow cluster.proto's contract with a deterministic stand-in
  "model" (the next token is a function of the context), so placement, local/remote
  prefill, refusals, retries, migration without duplicates, cancellation propagation and
  overload are checked exactly, without engines.  The real workers' end-to-end tests live
  with them.

Timing bounds are generous: they catch hangs only.
"""
from __future__ import annotations

import math
import os
import random
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
    exe = bin_dir / "chunkserve-mktiny"
    if not exe.is_file():
        pytest.skip(f"{exe} not built")
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run([str(exe), "--out", str(out)], check=True, capture_output=True)
    return out / "tiny.gguf"


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
    g = pb.generation_pb2
    f = dict(fields)
    if "sampling" in f:
        f["sampling"] = g.SamplingParams(**f["sampling"])
    if "token_ids" in f:
        f["token_ids"] = g.TokenIds(**f["token_ids"])
    if "chat" in f:
        f["chat"] = g.Chat(messages=[g.ChatMessage(**m) for m in f["chat"]["messages"]])
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(alone.stub.Generate(g.GenerateRequest(**f), timeout=20))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert words in e.value.details()
    assert time.monotonic() - t0 < 5


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


# ======================================================= behind fake workers --

def next_token(ctx):
    """The fake workers' 'model': a pure function of the context (greedy-like)."""
    return (ctx[-1] * 7 + len(ctx) * 13 + 5) % TINY_VOCAB


def expected(prompt, n):
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt):]


_KV = {}  # kv_endpoint -> decode FakeWorker (prefill fakes signal through it)
_KV_LOCK = threading.Lock()


class FakeWorker:
    """A chunkserve.v1.Worker in this process, following cluster.proto's contract.  Knobs:
    refuse (RESOURCE_EXHAUSTED before admitting), fail_before_admit (a status code),
    fail_after (abort UNAVAILABLE after that many tokens of a stream), fail_prefill,
    invalid (INVALID_ARGUMENT), token_delay (seconds between tokens)."""

    def __init__(self, pb, role, pages=256, name=None, port=0):
        self.pb = pb
        c = pb.cluster_pb2
        self.role = role
        self.pages = pages
        self.instance_id = random.getrandbits(63) + 1
        self.refuse = False
        self.fail_before_admit = None
        self.fail_after = None
        self.fail_prefill = None
        self.invalid = False
        self.hang_after = None  # after that many tokens: stop answering anything (a hung process)
        self.hung = False
        self.stall_admission = False  # never admit nor refuse (its status stays fine)
        self.overrun = 0  # a buggy worker: sends this many tokens past max_tokens, in one message
        self.token_delay = 0.002
        self.decode_requests, self.prefill_requests, self.cancel_requests = [], [], []
        self.ended = []  # (transfer_id, finished normally)
        self.lock = threading.Lock()
        self.prefilled = {}
        self.server = grpc.server(ThreadPoolExecutor(max_workers=32))
        handlers = {
            "GetStatus": grpc.unary_unary_rpc_method_handler(
                self.get_status, request_deserializer=c.WorkerStatusRequest.FromString,
                response_serializer=c.WorkerStatus.SerializeToString),
            "Cancel": grpc.unary_unary_rpc_method_handler(
                self.cancel, request_deserializer=c.CancelRequest.FromString,
                response_serializer=c.CancelResponse.SerializeToString),
        }
        if role == "decode":
            handlers["Decode"] = grpc.unary_stream_rpc_method_handler(
                self.decode, request_deserializer=c.DecodeRequest.FromString,
                response_serializer=c.DecodeResponse.SerializeToString)
        else:
            handlers["Prefill"] = grpc.unary_unary_rpc_method_handler(
                self.prefill, request_deserializer=c.PrefillRequest.FromString,
                response_serializer=c.PrefillResponse.SerializeToString)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("chunkserve.v1.Worker", handlers),))
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()
        self.addr = f"127.0.0.1:{self.port}"
        self.name = name or f"fake-{role}-{self.port}"
        self.kv_endpoint = f"127.0.0.1:{self.port + 1}"  # never dialled: prefill fakes use _KV
        if role == "decode":
            with _KV_LOCK:
                _KV[self.kv_endpoint] = self

    def close(self):
        self.server.stop(0)
        with _KV_LOCK:
            _KV.pop(self.kv_endpoint, None)

    def hang(self, ctx):
        while self.hung and ctx.is_active():
            time.sleep(0.02)

    def get_status(self, req, ctx):
        c, g = self.pb.cluster_pb2, self.pb.generation_pb2
        self.hang(ctx)
        return c.WorkerStatus(
            worker_id=self.name, instance_id=self.instance_id,
            role=c.WORKER_ROLE_DECODE if self.role == "decode" else c.WORKER_ROLE_PREFILL,
            model=g.ModelInfo(name=TINY_NAME, context_length=TINY_CTX, vocab_size=TINY_VOCAB),
            ready=True, page_size=16, kv_pages_total=self.pages, kv_pages_free=self.pages,
            kv_endpoint=self.kv_endpoint, kv_transport=c.KV_TRANSPORT_TCP)

    def cancel(self, req, ctx):
        with self.lock:
            self.cancel_requests.append(req)
        return self.pb.cluster_pb2.CancelResponse(found=False)

    def prefilled_event(self, transfer_id):
        with self.lock:
            return self.prefilled.setdefault(transfer_id, threading.Event())

    def prefill(self, req, ctx):
        with self.lock:
            self.prefill_requests.append(req)
        if self.fail_prefill is not None:
            ctx.abort(self.fail_prefill, "fake prefill failure")
        with _KV_LOCK:
            dec = _KV.get(req.kv_endpoint)
        if dec is None:
            ctx.abort(grpc.StatusCode.UNAVAILABLE, f"no decode worker at {req.kv_endpoint}")
        dec.prefilled_event(req.transfer_id).set()
        return self.pb.cluster_pb2.PrefillResponse(first_token_id=next_token(list(req.token_ids)),
                                                   num_tokens=len(req.token_ids))

    def decode(self, req, ctx):
        c, g = self.pb.cluster_pb2, self.pb.generation_pb2
        with self.lock:
            self.decode_requests.append(req)
        state = {"ok": False}
        ctx.add_callback(lambda: self.ended.append((req.transfer_id, state["ok"])))
        if self.fail_before_admit is not None:
            ctx.abort(self.fail_before_admit, "fake failure before admission")
        pages = math.ceil(len(req.token_ids) / 16)
        if self.refuse or pages > self.pages:
            ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake: no room")
        if self.invalid:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake: sampling.seed is not acceptable")
        while self.stall_admission and ctx.is_active():
            time.sleep(0.02)
        if not ctx.is_active():
            return
        yield c.DecodeResponse(admitted=c.DecodeAdmitted(
            transfer_id=req.transfer_id, pages_reserved=pages, kv_endpoint=self.kv_endpoint,
            kv_transport=c.KV_TRANSPORT_TCP))
        if not req.local_prefill:
            ev = self.prefilled_event(req.transfer_id)
            t0 = time.monotonic()
            while not ev.wait(0.05):
                if not ctx.is_active():
                    return
                if time.monotonic() - t0 > 10:
                    ctx.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "fake: the KV never arrived")
        seq = list(req.token_ids)
        max_tokens = req.sampling.max_tokens or 50
        done = len(seq) - req.num_prompt_tokens
        emitted = 0
        while done < max_tokens:
            if self.fail_after is not None and emitted >= self.fail_after:
                ctx.abort(grpc.StatusCode.UNAVAILABLE, "fake worker died")
            if self.hang_after is not None and emitted >= self.hang_after:
                self.hung = True
                self.hang(ctx)
                return
            t = next_token(seq)
            seq.append(t)
            done += 1
            emitted += 1
            last = done == max_tokens
            out = g.GenerateResponse(token_ids=[t], text=f"<{t}>", request_id=req.request_id)
            if req.sampling.logprobs:
                out.logprobs.append(g.TokenLogprob(token_id=t, logprob=-0.5))
            if last and self.overrun:
                extra = expected(seq, self.overrun)
                out.token_ids.extend(extra)
                out.logprobs.extend(g.TokenLogprob(token_id=x, logprob=-1.0) for x in extra)
                last = False
            if last:
                out.finish_reason = g.FINISH_REASON_LENGTH
                out.usage.CopyFrom(g.Usage(prompt_tokens=req.num_prompt_tokens,
                                           completion_tokens=done))
            yield c.DecodeResponse(output=out, rng_state=c.RngState(s=[1, 2, 3, done]))
            if self.token_delay:
                time.sleep(self.token_delay)
        state["ok"] = True


@pytest.fixture
def fakes(pb):
    made = []

    def make(role="decode", **kw):
        w = FakeWorker(pb, role, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


FAST = ["--status-interval-ms", "50", "--no-worker-wait-ms", "1500", "--queue-timeout-ms", "1500"]


def gen(pb, ids, max_tokens, **sampling):
    g = pb.generation_pb2
    return g.GenerateRequest(token_ids=g.TokenIds(ids=ids),
                             sampling=g.SamplingParams(max_tokens=max_tokens, **sampling))


def test_local_prefill_stream(start_router, fakes, pb):
    d = fakes("decode")
    r = start_router("--decode-workers", d.addr, *FAST)
    r.wait_ready()
    assert r.metric('chunkserve:workers_usable{role="decode"}') == 1
    prompt = [1, 40, 258, 7]
    ids, text, msgs = collect(r.stub.Generate(gen(pb, prompt, 12), timeout=20))
    assert ids == expected(prompt, 12)
    assert text == "".join(f"<{t}>" for t in ids)
    assert msgs[0].request_id.startswith("rt-") and all(m.request_id == "" for m in msgs[1:])
    assert msgs[-1].finish_reason == pb.generation_pb2.FINISH_REASON_LENGTH
    assert (msgs[-1].usage.prompt_tokens, msgs[-1].usage.completion_tokens) == (4, 12)
    (dreq,) = d.decode_requests
    assert dreq.local_prefill and list(dreq.token_ids) == prompt and dreq.num_prompt_tokens == 4
    assert dreq.sampling.max_tokens == 12 and dreq.lease_ms == 120000 and dreq.transfer_id != 0
    assert dreq.request_id == msgs[0].request_id
    # the client's own id is used as is
    _, _, msgs = collect(r.stub.Generate(pb.generation_pb2.GenerateRequest(
        request_id="client-7", prompt="hello", sampling=pb.generation_pb2.SamplingParams(max_tokens=2)),
        timeout=20))
    assert msgs[0].request_id == "client-7"
    assert d.decode_requests[1].transfer_id != dreq.transfer_id
    assert r.metric('chunkserve:prefills_total{path="local"}') == 2
    assert r.metric('chunkserve:requests_total{code="OK"}') == 2
    assert r.metric("chunkserve:generation_tokens_total") == 14
    assert r.metric("chunkserve:time_to_first_token_seconds_count") == 2
    assert r.metric("chunkserve:router_overhead_seconds_count") == 2
    assert r.metric("chunkserve:num_requests_running") == 0


def test_remote_prefill(start_router, fakes, pb):
    d, p = fakes("decode"), fakes("prefill")
    r = start_router("--decode-workers", d.addr, "--prefill-workers", p.addr,
                     "--local-prefill-threshold", "8", *FAST)
    r.wait_ready()
    time.sleep(0.2)  # the prefill worker's status too
    long_prompt = list(range(20, 60))
    ids, _, _ = collect(r.stub.Generate(gen(pb, long_prompt, 5), timeout=20))
    assert ids == expected(long_prompt, 5)
    dreq, preq = d.decode_requests[-1], p.prefill_requests[-1]
    assert not dreq.local_prefill
    assert preq.transfer_id == dreq.transfer_id and list(preq.token_ids) == long_prompt
    assert preq.kv_endpoint == d.kv_endpoint and preq.decode_worker_id == d.name
    assert preq.num_prompt_tokens == len(long_prompt) and preq.sampling.max_tokens == 5
    # under the threshold: local, the prefill worker is not asked
    ids, _, _ = collect(r.stub.Generate(gen(pb, [3, 4, 5], 3), timeout=20))
    assert ids == expected([3, 4, 5], 3)
    assert d.decode_requests[-1].local_prefill and len(p.prefill_requests) == 1
    assert r.metric('chunkserve:prefills_total{path="remote"}') == 1
    assert r.metric('chunkserve:prefills_total{path="local"}') == 1


def test_refusal_goes_to_the_next_worker_then_resource_exhausted(start_router, fakes, pb):
    a, b = fakes("decode"), fakes("decode")
    a.refuse = True
    r = start_router("--decode-workers", f"{a.addr},{b.addr}", *FAST)
    r.wait_ready()
    time.sleep(0.2)
    for _ in range(4):  # whichever is tried first, b serves
        ids, _, _ = collect(r.stub.Generate(gen(pb, [9, 8, 7], 4), timeout=20))
        assert ids == expected([9, 8, 7], 4)
    assert len(b.decode_requests) == 4
    assert r.metric("chunkserve:retries_total") == 0  # a refusal is not a failure
    b.refuse = True
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(r.stub.Generate(gen(pb, [9, 8, 7], 4), timeout=20))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert time.monotonic() - t0 < 10
    # it kept asking while it waited (a refusal lasts until the worker's next status)
    assert len(a.decode_requests) + len(b.decode_requests) > 6
    # room again: served
    a.refuse = b.refuse = False
    ids, _, _ = collect(r.stub.Generate(gen(pb, [9, 8, 7], 4), timeout=20))
    assert ids == expected([9, 8, 7], 4)


def test_worker_too_small_is_skipped(start_router, fakes, pb):
    small, big = fakes("decode", pages=2), fakes("decode", pages=64)
    r = start_router("--decode-workers", f"{small.addr},{big.addr}", *FAST)
    r.wait_ready()
    time.sleep(0.2)
    prompt = list(range(1, 100))  # 7 pages
    ids, _, _ = collect(r.stub.Generate(gen(pb, prompt, 3), timeout=20))
    assert ids == expected(prompt, 3)
    assert not small.decode_requests and len(big.decode_requests) == 1


def test_retry_before_tokens(start_router, fakes, pb):
    a, b = fakes("decode", pages=1000), fakes("decode", pages=100)  # a is preferred (room)
    a.fail_before_admit = grpc.StatusCode.INTERNAL
    r = start_router("--decode-workers", f"{a.addr},{b.addr}", *FAST)
    r.wait_ready()
    time.sleep(0.2)
    ids, _, _ = collect(r.stub.Generate(gen(pb, [5, 6], 6), timeout=20))
    assert ids == expected([5, 6], 6)
    assert len(a.decode_requests) == 1 and len(b.decode_requests) == 1
    assert a.decode_requests[0].transfer_id != b.decode_requests[0].transfer_id
    assert r.metric("chunkserve:retries_total") == 1
    assert r.metric("chunkserve:migrations_total") == 0


def test_migration_continues_without_duplicates(start_router, fakes, pb):
    a, b = fakes("decode", pages=1000), fakes("decode", pages=100)
    a.fail_after = 5
    r = start_router("--decode-workers", f"{a.addr},{b.addr}", *FAST)
    r.wait_ready()
    time.sleep(0.2)
    prompt = [11, 12, 13]
    ids, text, msgs = collect(r.stub.Generate(gen(pb, prompt, 20), timeout=20))
    assert ids == expected(prompt, 20)  # exact, no duplicate, no gap
    assert text == "".join(f"<{t}>" for t in ids)
    assert msgs[-1].usage.completion_tokens == 20 and msgs[-1].usage.prompt_tokens == 3
    assert msgs[0].request_id and all(not m.request_id for m in msgs[1:])
    (breq,) = b.decode_requests
    assert list(breq.token_ids) == prompt + ids[:5] and breq.num_prompt_tokens == 3
    assert breq.sampling.max_tokens == 20
    assert list(breq.rng_state.s) == [1, 2, 3, 5]  # the latest state the router saw
    assert r.metric("chunkserve:migrations_total") == 1
    assert r.metric("chunkserve:retries_total") == 0


def test_hung_worker_is_failed_over(start_router, fakes, pb):
    """A worker that stops answering (its connections stay open: a stopped or hung process)
    is declared down after a few seconds without a status, and its streams migrate."""
    a, b = fakes("decode", pages=1000), fakes("decode", pages=100)
    a.hang_after = 4
    r = start_router("--decode-workers", f"{a.addr},{b.addr}", *FAST)
    r.wait_ready()
    time.sleep(0.2)
    prompt = [21, 22]
    t0 = time.monotonic()
    ids, _, _ = collect(r.stub.Generate(gen(pb, prompt, 10), timeout=30))
    assert ids == expected(prompt, 10)
    assert time.monotonic() - t0 < 15
    (breq,) = b.decode_requests
    assert list(breq.token_ids) == prompt + ids[:4]
    assert r.metric("chunkserve:migrations_total") == 1
    assert "has not answered a status poll" in r.stderr()
    a.hung = False


def test_admission_is_bounded_by_the_lease(start_router, fakes, pb):
    a, b = fakes("decode", pages=1000), fakes("decode", pages=100)
    a.stall_admission = True
    r = start_router("--decode-workers", f"{a.addr},{b.addr}", "--lease-ms", "700", *FAST)
    r.wait_ready()
    time.sleep(0.2)
    ids, _, _ = collect(r.stub.Generate(gen(pb, [8, 9], 3), timeout=30))
    assert ids == expected([8, 9], 3)
    assert len(a.decode_requests) == 1 and len(b.decode_requests) == 1
    assert b.decode_requests[0].lease_ms == 700
    assert r.metric("chunkserve:retries_total") == 1
    a.stall_admission = False


def test_migration_to_remote_prefill_by_context_length(start_router, fakes, pb):
    a, b, p = fakes("decode", pages=1000), fakes("decode", pages=100), fakes("prefill")
    a.fail_after = 6
    r = start_router("--decode-workers", f"{a.addr},{b.addr}", "--prefill-workers", p.addr,
                     "--local-prefill-threshold", "8", *FAST)
    r.wait_ready()
    time.sleep(0.2)
    prompt = [1, 2, 3]  # local at first; 3 + 6 = 9 tokens after the failure: remote
    ids, _, _ = collect(r.stub.Generate(gen(pb, prompt, 10), timeout=20))
    assert ids == expected(prompt, 10)
    assert a.decode_requests[0].local_prefill and not b.decode_requests[0].local_prefill
    (preq,) = p.prefill_requests
    assert list(preq.token_ids) == prompt + ids[:6] and preq.num_prompt_tokens == 3
    assert preq.decode_worker_id == b.name


def test_prefill_failure_retries_and_cancels_decode(start_router, fakes, pb):
    d, p1, p2 = fakes("decode"), fakes("prefill"), fakes("prefill")
    p1.fail_prefill = p2.fail_prefill = grpc.StatusCode.INTERNAL
    r = start_router("--decode-workers", d.addr, "--prefill-workers", f"{p1.addr},{p2.addr}",
                     "--local-prefill-threshold", "4", *FAST)
    r.wait_ready()
    time.sleep(0.2)
    prompt = list(range(30, 50))
    # both prefill workers fail: the third attempt prefills locally
    ids, _, _ = collect(r.stub.Generate(gen(pb, prompt, 4), timeout=20))
    assert ids == expected(prompt, 4)
    assert len(p1.prefill_requests) == 1 and len(p2.prefill_requests) == 1
    assert [q.local_prefill for q in d.decode_requests] == [False, False, True]
    # the decode calls of the failed attempts were cancelled (the worker frees on cancel)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(d.ended) < 3:
        time.sleep(0.05)
    assert sorted(ok for _, ok in d.ended) == [False, False, True]
    assert r.metric("chunkserve:retries_total") == 2


def test_invalid_argument_from_a_worker_goes_to_the_client(start_router, fakes, pb):
    a = fakes("decode")
    a.invalid = True
    r = start_router("--decode-workers", a.addr, *FAST)
    r.wait_ready()
    with pytest.raises(grpc.RpcError) as e:
        list(r.stub.Generate(gen(pb, [1, 2], 3), timeout=20))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.seed" in e.value.details()
    assert len(a.decode_requests) == 1 and r.metric("chunkserve:retries_total") == 0


def test_max_retries_then_unavailable(start_router, fakes, pb):
    ws = [fakes("decode") for _ in range(3)]
    for w in ws:
        w.fail_before_admit = grpc.StatusCode.UNAVAILABLE
    r = start_router("--decode-workers", ",".join(w.addr for w in ws), "--max-retries", "2", *FAST)
    r.wait_ready()
    time.sleep(0.2)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(r.stub.Generate(gen(pb, [1, 2], 3), timeout=20))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "3 attempts failed" in e.value.details()
    assert time.monotonic() - t0 < 10
    assert sum(len(w.decode_requests) for w in ws) == 3  # each worker tried once


def test_client_cancel_reaches_the_worker(start_router, fakes, pb):
    d = fakes("decode")
    d.token_delay = 0.02
    r = start_router("--decode-workers", d.addr, *FAST)
    r.wait_ready()
    it = r.stub.Generate(gen(pb, [4, 5, 6], 1000), timeout=30)
    for _ in range(3):
        next(it)
    it.cancel()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not d.ended:
        time.sleep(0.02)
    assert d.ended and d.ended[0][1] is False, "the worker's Decode call was not cancelled"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and r.metric('chunkserve:requests_total{code="CANCELLED"}') != 1:
        time.sleep(0.05)
    assert r.metric('chunkserve:requests_total{code="CANCELLED"}') == 1
    assert r.metric("chunkserve:num_requests_running") == 0


def test_client_deadline_reaches_the_worker(start_router, fakes, pb):
    d = fakes("decode")
    d.token_delay = 0.05
    r = start_router("--decode-workers", d.addr, *FAST)
    r.wait_ready()
    with pytest.raises(grpc.RpcError) as e:
        list(r.stub.Generate(gen(pb, [4, 5, 6], 1000), timeout=1.0))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not d.ended:
        time.sleep(0.02)
    assert d.ended and d.ended[0][1] is False


def test_overload_is_refused_at_once(start_router, fakes, pb):
    d = fakes("decode")
    d.token_delay = 0.05
    r = start_router("--decode-workers", d.addr, "--max-inflight", "1", "--max-queue", "1", *FAST,
                     "--queue-timeout-ms", "20000")
    r.wait_ready()
    first = r.stub.Generate(gen(pb, [1, 2], 40), timeout=30)
    next(first)  # placed and streaming
    second = r.stub.Generate(gen(pb, [1, 2], 2), timeout=30)  # waits for the slot
    time.sleep(0.2)
    assert r.metric("chunkserve:num_requests_waiting") == 1
    assert r.metric("chunkserve:num_requests_running") == 1
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(r.stub.Generate(gen(pb, [1, 2], 2), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - t0 < 2
    assert len(list(first)) == 39
    ids, _, _ = collect(second)  # got the slot once the first finished
    assert ids == expected([1, 2], 2)


def test_burst_through_a_small_window(start_router, fakes, pb):
    """64 concurrent requests through --max-inflight 4 over two workers: all complete, exact,
    in a bounded time; both workers used; the gauges are back to 0."""
    a, b = fakes("decode"), fakes("decode")
    r = start_router("--decode-workers", f"{a.addr},{b.addr}", "--max-inflight", "4", *FAST,
                     "--queue-timeout-ms", "30000")
    r.wait_ready()
    time.sleep(0.2)

    def one(i):
        prompt = [i % 300 + 1, 5, 6]
        ids, _, _ = collect(r.stub.Generate(gen(pb, prompt, 8), timeout=60))
        return ids == expected(prompt, 8)

    with ThreadPoolExecutor(64) as ex:
        results = list(ex.map(one, range(64)))
    assert all(results)
    assert a.decode_requests and b.decode_requests
    assert len(a.decode_requests) + len(b.decode_requests) == 64
    assert r.metric('chunkserve:requests_total{code="OK"}') == 64
    assert r.metric("chunkserve:num_requests_running") == 0
    assert r.metric("chunkserve:num_requests_waiting") == 0


def test_sigterm_with_streams(start_router, fakes, pb):
    """SIGTERM: a short stream finishes within the grace period; a long one ends UNAVAILABLE
    after it, its worker call cancelled; new calls are refused; the router exits 0."""
    d = fakes("decode")
    d.token_delay = 0.02
    r = start_router("--decode-workers", d.addr, "--grace-ms", "600", *FAST)
    r.wait_ready()
    short = r.stub.Generate(gen(pb, [1, 2], 10), timeout=30)   # ~0.2 s
    long = r.stub.Generate(gen(pb, [3, 4], 1000), timeout=30)  # ~20 s
    next(short)
    next(long)
    r.proc.send_signal(signal.SIGTERM)
    ids = [1] + [t for m in short for t in m.token_ids]
    assert len(ids) == 10
    with pytest.raises(grpc.RpcError) as e:
        list(long)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert r.wait_exit() < 10
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(d.ended) < 2:
        time.sleep(0.02)
    assert sorted(ok for _, ok in d.ended) == [False, True]


def test_never_more_tokens_than_max(start_router, fakes, pb):
    """A worker that overruns max_tokens is cut at max_tokens (finish LENGTH), logprobs too."""
    d = fakes("decode")
    d.overrun = 3
    r = start_router("--decode-workers", d.addr, *FAST)
    r.wait_ready()
    ids, _, msgs = collect(r.stub.Generate(gen(pb, [2, 3], 5, logprobs=True), timeout=20))
    assert ids == expected([2, 3], 5)
    assert [lp.token_id for m in msgs for lp in m.logprobs] == ids
    assert msgs[-1].finish_reason == pb.generation_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == 5
    assert "truncated" in r.stderr()


def test_dns_discovery_and_readiness(start_router, fakes, pb):
    d = fakes("decode")
    r = start_router("--decode-dns", f"localhost:{d.port}", "--dns-refresh-ms", "200", *FAST)
    r.wait_ready()
    ids, _, _ = collect(r.stub.Generate(gen(pb, [7, 7], 3), timeout=20))
    assert ids == expected([7, 7], 3)
    assert "dns localhost" in r.stderr()


def test_worker_of_another_model_or_role_is_not_used(start_router, fakes, pb):
    p = fakes("prefill")
    r = start_router("--decode-workers", p.addr, *FAST)  # a prefill worker listed as decode
    time.sleep(0.5)
    assert r.get("/readyz")[0] == 503
    with pytest.raises(grpc.RpcError) as e:
        list(r.stub.Generate(gen(pb, [1], 2), timeout=20))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "wrong role" in r.stderr() or "not a decode worker" in r.stderr()


def test_worker_restart_and_death(start_router, fakes, pb):
    """A worker that goes away stops being used (UNAVAILABLE after the no-worker wait); a new
    instance on the same address is used again, and the restart is logged."""
    d = fakes("decode")
    r = start_router("--decode-workers", d.addr, *FAST)
    r.wait_ready()
    d.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and r.get("/readyz")[0] == 200:
        time.sleep(0.05)
    assert r.get("/readyz")[0] == 503
    with pytest.raises(grpc.RpcError) as e:
        list(r.stub.Generate(gen(pb, [1], 2), timeout=20))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    time.sleep(3)  # the worker is down a while (gRPC backs off its reconnects)
    d2 = fakes("decode", port=d.port)
    r.wait_ready(timeout=15)
    ids, _, _ = collect(r.stub.Generate(gen(pb, [1], 2), timeout=20))
    assert ids == expected([1], 2)
    assert len(d2.decode_requests) == 1
    assert "restarted" in r.stderr()
