"""`chunkserve serve` against a real gRPC client: Python grpcio stubs generated from proto/
with grpcio-tools call the single-process server as a separate process on loopback.

Most checks run on the tiny random-weight model (fast); the greedy-equals-CLI check, the
deadline and the overload check run on the real default model, whose steps are slow enough
to keep requests in flight.  The tiny server's KV pool (--kv-cache-mib 2: 256 pages of 16
tokens) holds exactly one sequence that fills the whole 4096-token context, so a request
that generates until the context is full after a cancelled one proves the cancelled one's
pages were freed.  Timing bounds are generous: they catch hangs only.
"""
from __future__ import annotations

import random
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_tools.protoc")  # stubs: conftest.proto_modules

from refusals import FIELD_CASES, generate_request, refusal_field  # noqa: E402

SERVICE = "chunkserve.v1.Generation"
TINY_NAME = "chunkserve tiny test model"
TINY_CTX = 4096


@pytest.fixture(scope="module")
def pb(proto_modules):
    """The generated modules as attributes: pb.generation_pb2, pb.health_pb2, ..."""
    return type("PB", (), proto_modules)


class Server:
    """A `chunkserve serve` process with a channel and stub to it.  Its stderr goes to a file,
    not a pipe: a log line per request would fill a pipe nobody reads and block the server."""

    def __init__(self, exe: Path, model: Path, pb, *args):
        self.pb = pb
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([str(exe), "serve", "--model", str(model), "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=self.err)
        line = self.proc.stdout.readline().decode()
        if not line.startswith("listening on "):
            self.proc.kill()
            pytest.fail(f"unexpected first line {line!r}; stderr: {self.stderr()[-3000:]!r}")
        self.addr = line.split()[-1]
        self.channel = grpc.insecure_channel(self.addr)
        self.stub = pb.generation_pb2_grpc.GenerationStub(self.channel)
        self.worker = pb.cluster_pb2_grpc.WorkerStub(self.channel)

    def status(self):
        return self.worker.GetStatus(self.pb.cluster_pb2.WorkerStatusRequest(), timeout=10)

    def stop(self, timeout=15.0):
        """SIGTERM; asserts exit 0 within timeout; returns the seconds it took."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"server did not exit within {timeout}s of SIGTERM")
        self.channel.close()
        err = self.stderr()
        assert rc == 0, f"server exit {rc}: {err[-3000:]}"
        # Sanitizer builds (make test runs the tiny tests on one): no report, even a non-fatal one.
        assert "Sanitizer" not in err and "runtime error:" not in err, err[-6000:]
        return time.monotonic() - t0

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")


@pytest.fixture(scope="module")
def tiny_model(bin_dir, tmp_path_factory):
    exe = bin_dir / "chunkserve-mktiny"
    if not exe.is_file():
        pytest.skip(f"{exe} not built")
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run([str(exe), "--out", str(out)], check=True, capture_output=True)
    return out / "tiny.gguf"


@pytest.fixture(scope="module")
def tiny(chunkserve_bin, tiny_model, pb):
    s = Server(chunkserve_bin, tiny_model, pb, "--kv-cache-mib", "2", "--max-batched-tokens", "256",
               "--threads", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def real(chunkserve_bin, model_path, pb):
    """The real model, one sequence at a time, at most one waiting."""
    s = Server(chunkserve_bin, model_path, pb, "--max-num-seqs", "1", "--max-queue", "1")
    yield s
    s.stop()


def params(pb, **kw):
    return pb.generation_pb2.SamplingParams(**kw)


def collect(stream):
    """(ids, text, messages) of a finished stream."""
    msgs = list(stream)
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs), msgs


# ---------------------------------------------------------------- unary calls --

def test_list_models(tiny, pb):
    r = tiny.stub.ListModels(pb.generation_pb2.ListModelsRequest(), timeout=5)
    assert len(r.models) == 1
    m = r.models[0]
    assert (m.name, m.context_length, m.vocab_size, m.architecture) == (TINY_NAME, TINY_CTX, 349, "llama")
    assert m.has_chat_template


def test_tokenize_detokenize_round_trip(tiny, pb):
    g = pb.generation_pb2
    for text in ("Hello, world!", "naïve café — 你好 🙂", "  spaces\n\tand tabs  "):
        ids = tiny.stub.Tokenize(g.TokenizeRequest(text=text), timeout=5).ids
        assert len(ids) > 0
        assert tiny.stub.Detokenize(g.DetokenizeRequest(ids=ids), timeout=5).text == text
    # by model name and by file name; a chat renders through the template
    chat = g.Chat(messages=[g.ChatMessage(role="user", content="hi")])
    ids = tiny.stub.Tokenize(g.TokenizeRequest(model="tiny.gguf", chat=chat), timeout=5).ids
    text = tiny.stub.Detokenize(g.DetokenizeRequest(model=TINY_NAME, ids=ids, include_special=True),
                                timeout=5).text
    assert "hi" in text and text.startswith("<|im_start|>")
    with pytest.raises(grpc.RpcError) as e:
        tiny.stub.Detokenize(g.DetokenizeRequest(ids=[1, 349]), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ids[1] = 349" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        tiny.stub.Tokenize(g.TokenizeRequest(model="gpt-9", text="x"), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown model" in e.value.details()


def test_health_check_and_watch(tiny, pb):
    h = pb.health_pb2
    check = tiny.channel.unary_unary("/grpc.health.v1.Health/Check",
                                     request_serializer=h.HealthCheckRequest.SerializeToString,
                                     response_deserializer=h.HealthCheckResponse.FromString)
    watch = tiny.channel.unary_stream("/grpc.health.v1.Health/Watch",
                                      request_serializer=h.HealthCheckRequest.SerializeToString,
                                      response_deserializer=h.HealthCheckResponse.FromString)
    for service in ("", SERVICE):
        assert check(h.HealthCheckRequest(service=service), timeout=5).status == h.HealthCheckResponse.SERVING
    it = watch(h.HealthCheckRequest(service=""), timeout=10)
    assert next(it).status == h.HealthCheckResponse.SERVING
    it.cancel()


# ------------------------------------------------------------------ generation --

def test_prefix_cache_usage(tiny, pb):
    """A second request sharing a long prompt prefix reports the whole pages it reused."""
    g = pb.generation_pb2
    shared = list(range(10, 10 + 200))
    usage = []
    for tail in ([7, 8, 9], [17, 18, 19]):
        _, _, msgs = collect(tiny.stub.Generate(g.GenerateRequest(
            token_ids=g.TokenIds(ids=shared + tail), sampling=params(pb, max_tokens=2, ignore_eos=True)),
            timeout=30))
        usage.append(msgs[-1].usage)
    assert usage[1].prompt_tokens == 203
    assert usage[1].cached_prompt_tokens == 192, usage[1]  # 12 full pages of 16 tokens


def test_generate_stream(tiny, pb):
    g = pb.generation_pb2
    req = g.GenerateRequest(request_id="py-gen-1", prompt="hello",
                            sampling=params(pb, max_tokens=40, ignore_eos=True, logprobs=True))
    ids, text, msgs = collect(tiny.stub.Generate(req, timeout=30))
    assert msgs[0].request_id == "py-gen-1"
    assert all(m.finish_reason == g.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == g.FINISH_REASON_LENGTH
    prompt_ids = tiny.stub.Tokenize(g.TokenizeRequest(text="hello", add_special=True), timeout=5).ids
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt_ids), 40)
    assert len(ids) == 40
    lps = [lp for m in msgs for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == ids and all(lp.logprob <= 0 for lp in lps)
    assert text == tiny.stub.Detokenize(g.DetokenizeRequest(ids=ids), timeout=5).text
    # the same prompt as token ids gives the same greedy tokens
    ids2, _, _ = collect(tiny.stub.Generate(g.GenerateRequest(
        token_ids=g.TokenIds(ids=prompt_ids), sampling=params(pb, max_tokens=40, ignore_eos=True)),
        timeout=30))
    assert ids2 == ids
    # a chat; a stop string ends it and is not shown
    chat = g.Chat(messages=[g.ChatMessage(role="system", content="be brief"),
                            g.ChatMessage(role="user", content="hi")])
    _, text, msgs = collect(tiny.stub.Generate(g.GenerateRequest(chat=chat, sampling=params(
        pb, max_tokens=30, ignore_eos=True)), timeout=30))
    assert msgs[-1].finish_reason == g.FINISH_REASON_LENGTH and msgs[-1].usage.completion_tokens == 30
    if len(text) > 4:
        stop = text[2:4]
        _, text2, msgs2 = collect(tiny.stub.Generate(g.GenerateRequest(chat=chat, sampling=params(
            pb, max_tokens=30, ignore_eos=True, stop=[stop])), timeout=30))
        assert msgs2[-1].finish_reason == g.FINISH_REASON_STOP
        assert stop not in text2 and text.startswith(text2)


BAD_INPUTS = [
    # (fields of GenerateRequest, words the message must contain)
    (dict(prompt=""), "empty"),
    (dict(), "no input"),
    (dict(token_ids={"ids": []}), "token_ids is empty"),
    (dict(token_ids={"ids": [5, 349]}), "outside the vocabulary"),
    (dict(token_ids={"ids": [-1]}), "outside the vocabulary"),
    (dict(token_ids={"ids": [5] * TINY_CTX}), "context"),
    (dict(prompt="x" * 1_000_000), "bytes: more than"),  # refused before tokenizing
    (dict(chat={"messages": []}), "no messages"),
    (dict(chat={"messages": [{"role": "robot", "content": "x"}]}), "role"),
    (dict(model="gpt-9", prompt="x"), "unknown model"),
    (dict(prompt="x", sampling=dict(temperature=-1)), "temperature"),
    (dict(prompt="x", sampling=dict(top_p=1.5)), "top_p"),
    (dict(prompt="x", sampling=dict(top_p=-0.1)), "top_p"),
    (dict(prompt="x", sampling=dict(top_k=-1)), "top_k"),
    (dict(prompt="x", sampling=dict(min_p=1.5)), "min_p"),
    (dict(prompt="x", sampling=dict(repetition_penalty=-1)), "repetition_penalty"),
    (dict(prompt="x", sampling=dict(presence_penalty=2.5)), "presence_penalty"),
    (dict(prompt="x", sampling=dict(frequency_penalty=-3)), "frequency_penalty"),
    (dict(prompt="x", sampling=dict(max_tokens=-1)), "max_tokens"),
    (dict(prompt="x", sampling=dict(stop=[f"s{i}" for i in range(65)])), "at most 64"),
    (dict(prompt="x", sampling=dict(stop=[""])), "stop[0]"),
    (dict(prompt="x", sampling=dict(stop_token_ids=[400])), "stop_token_ids"),
]


@pytest.mark.parametrize("fields,words", BAD_INPUTS, ids=[w for _, w in BAD_INPUTS])
def test_bad_input(tiny, pb, fields, words):
    g = pb.generation_pb2
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(tiny.stub.Generate(generate_request(pb, fields), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert words in e.value.details()
    assert time.monotonic() - t0 < 5
    ids, _, _ = collect(tiny.stub.Generate(g.GenerateRequest(prompt="ok", sampling=params(
        pb, max_tokens=3, ignore_eos=True)), timeout=10))
    assert len(ids) == 3


@pytest.mark.parametrize("fields,field", FIELD_CASES, ids=[f for _, f in FIELD_CASES])
def test_refusal_names_the_field(tiny, pb, fields, field):
    """A refusal carries the request field it is about in a trailer (as the message spells it),
    so a client or the OpenAI door never parses the message to learn it."""
    assert refusal_field(tiny.stub, pb, fields) == field


def test_malformed_bytes(tiny, pb):
    """A burst of 1,000 random-byte messages (8 at a time) to every method and to unknown ones:
    each gets a status; the server keeps serving (and, under ASan, neither crashes nor leaks:
    the fixture checks the exit status and stderr at SIGTERM)."""
    methods = [f"/{SERVICE}/{m}" for m in ("Generate", "Tokenize", "Detokenize", "ListModels")]
    methods += ["/grpc.health.v1.Health/Check", f"/{SERVICE}/NoSuchMethod"]
    calls = [tiny.channel.unary_stream(m) for m in methods]
    rng = random.Random(7)
    bodies = []
    for i in range(1000):
        n = rng.randrange(1024, 8192) if i % 50 == 0 else rng.randrange(1, 48)
        bodies.append((i % len(calls), bytes(rng.randrange(256) for _ in range(n))))

    def one(job):
        k, body = job
        try:
            list(calls[k](body, timeout=10))
            return "OK"
        except grpc.RpcError as e:
            return e.code().name

    with ThreadPoolExecutor(8) as ex:
        codes = list(ex.map(one, bodies))
    allowed = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNIMPLEMENTED"}
    assert set(codes) <= allowed, {c: codes.count(c) for c in set(codes)}
    assert codes[5::6] == ["UNIMPLEMENTED"] * len(codes[5::6])
    assert tiny.stub.ListModels(pb.generation_pb2.ListModelsRequest(), timeout=5).models
    ids, _, _ = collect(tiny.stub.Generate(pb.generation_pb2.GenerateRequest(
        prompt="still serving", sampling=params(pb, max_tokens=5, ignore_eos=True)), timeout=10))
    assert len(ids) == 5


@pytest.fixture(scope="module")
def tiny_quant(chunkserve_bin, bin_dir, tmp_path_factory, pb):
    """The tiny model as a Q4_1 file: served in quant mode (the integer kernels), 2 threads."""
    out = tmp_path_factory.mktemp("tiny_q4_1")
    subprocess.run([str(bin_dir / "chunkserve-mktiny"), "--out", str(out), "--type", "q4_1"],
                   check=True, capture_output=True)
    s = Server(chunkserve_bin, out / "tiny.gguf", pb, "--kv-cache-mib", "2",
               "--max-batched-tokens", "64", "--threads", "2")
    yield s
    s.stop()


def test_32_concurrent_streams(tiny, pb):
    concurrent_streams(tiny, pb)


def test_32_concurrent_streams_quant(tiny_quant, pb):
    """Quant mode: a request's tokens (greedy and seeded) do not depend on the 31 others in its
    steps, nor on its prompt's chunking (budget 64), nor on the thread split."""
    concurrent_streams(tiny_quant, pb)


def concurrent_streams(tiny, pb):
    g = pb.generation_pb2
    results = [None] * 32

    def run(i):
        sp = params(pb, max_tokens=48, ignore_eos=True)
        if i % 2:  # sampled, seeded
            sp = params(pb, max_tokens=48, ignore_eos=True, temperature=0.9, top_p=0.9, seed=i)
        try:
            results[i] = collect(tiny.stub.Generate(g.GenerateRequest(prompt=f"stream {i % 4}",
                                                                      sampling=sp), timeout=60))
        except grpc.RpcError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert all(isinstance(r, tuple) for r in results), [r for r in results if not isinstance(r, tuple)]
    for ids, _, msgs in results:
        assert len(ids) == 48 and msgs[-1].finish_reason == g.FINISH_REASON_LENGTH
    # greedy output does not depend on what it was batched with
    for i in range(0, 32, 2):
        assert results[i][0] == results[i % 8][0]
    alone, _, _ = collect(tiny.stub.Generate(g.GenerateRequest(prompt="stream 0", sampling=params(
        pb, max_tokens=48, ignore_eos=True)), timeout=30))
    assert alone == results[0][0]
    # seeded sampling too: stream 5 alone == stream 5 among the others
    alone, _, _ = collect(tiny.stub.Generate(g.GenerateRequest(prompt="stream 1", sampling=params(
        pb, max_tokens=48, ignore_eos=True, temperature=0.9, top_p=0.9, seed=5)), timeout=30))
    assert alone == results[5][0]


def test_cancel_frees_pages(tiny, pb):
    """Cancel a stream that would fill the whole KV pool; then one that fills it must finish."""
    g = pb.generation_pb2
    full = g.GenerateRequest(prompt="fill the context", sampling=params(pb, ignore_eos=True))  # max_tokens 0
    it = tiny.stub.Generate(full, timeout=30)
    for i, _ in enumerate(it):
        if i == 5:
            it.cancel()
            break
    with pytest.raises(grpc.RpcError) as e:
        next(it)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    # the status call shows every page free again (cached prefix pages count as free)
    deadline = time.monotonic() + 10
    while True:
        st = tiny.status()
        if (st.kv_pages_free == st.kv_pages_total and st.num_running == 0 and st.num_waiting == 0) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert st.kv_pages_total > 0 and st.kv_pages_free == st.kv_pages_total, st
    assert st.num_running == 0 and st.num_waiting == 0 and st.ready and not st.draining, st
    ids, _, msgs = collect(tiny.stub.Generate(full, timeout=60))
    assert msgs[-1].finish_reason == g.FINISH_REASON_LENGTH
    assert msgs[-1].usage.prompt_tokens + len(ids) == TINY_CTX


# ------------------------------------------------------------ the real model --

def test_greedy_equals_cli(real, cli, pb):
    g = pb.generation_pb2
    for prompt, chat in (("The capital of France is", False), ("Name three colors.", True)):
        args = ["--prompt", prompt, "--max-tokens", "24"] + (["--chat"] if chat else [])
        want = cli.run("generate", *args, timeout=120).decode()
        assert want.endswith("\n")
        want = want[:-1]
        inp = (dict(chat=g.Chat(messages=[g.ChatMessage(role="user", content=prompt)])) if chat
               else dict(prompt=prompt))
        _, text, msgs = collect(real.stub.Generate(g.GenerateRequest(
            **inp, sampling=params(pb, max_tokens=24)), timeout=120))
        assert text == want, f"prompt {prompt!r}: server {text!r} != CLI {want!r}"
        assert msgs[-1].finish_reason in (g.FINISH_REASON_LENGTH, g.FINISH_REASON_STOP)


def test_deadline(real, pb):
    g = pb.generation_pb2
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(real.stub.Generate(g.GenerateRequest(prompt="Tell me a long story.", sampling=params(
            pb, max_tokens=2000, ignore_eos=True)), timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 5
    # the request was cancelled in the engine: the next one (max-num-seqs 1) runs at once
    ids, _, _ = collect(real.stub.Generate(g.GenerateRequest(prompt="Hi", sampling=params(
        pb, max_tokens=4, ignore_eos=True)), timeout=20))
    assert len(ids) == 4


def test_overload_refused(real, pb):
    """--max-num-seqs 1 --max-queue 1: one running, one waiting, the third is refused."""
    g = pb.generation_pb2
    long = g.GenerateRequest(prompt="Count to a thousand.", sampling=params(
        pb, max_tokens=2000, ignore_eos=True))
    a = real.stub.Generate(long, timeout=60)
    next(a)  # running
    b = real.stub.Generate(long, timeout=60)
    time.sleep(1.0)  # b reaches the server and waits
    with pytest.raises(grpc.RpcError) as e:
        list(real.stub.Generate(long, timeout=10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queue" in e.value.details()
    a.cancel()
    b.cancel()
    # Cancellation reaches the engine asynchronously: a client retries, as it would.
    deadline = time.monotonic() + 10
    while True:
        try:
            ids, _, _ = collect(real.stub.Generate(g.GenerateRequest(prompt="Hi", sampling=params(
                pb, max_tokens=2, ignore_eos=True)), timeout=20))
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.05)
    assert len(ids) == 2


def test_sigterm_with_streams_in_flight(chunkserve_bin, model_path, pb):
    s = Server(chunkserve_bin, model_path, pb, "--grace-ms", "500")
    g = pb.generation_pb2
    started = threading.Barrier(17)
    outcomes = [None] * 16

    def run(i):
        got = 0
        try:
            for _ in s.stub.Generate(g.GenerateRequest(prompt=f"Story number {i}:", sampling=params(
                    pb, max_tokens=3000, ignore_eos=True)), timeout=60):
                got += 1
                if got == 1:
                    started.wait(60)
            outcomes[i] = "OK"
        except grpc.RpcError as e:
            outcomes[i] = e.code().name

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    started.wait(60)
    took = s.stop(timeout=15)
    assert took < 5, f"exit took {took:.1f}s"
    for t in threads:
        t.join(30)
    assert outcomes == ["UNAVAILABLE"] * 16, outcomes


def test_cli_sampling_flags_come_from_the_sampling_table(chunkserve_bin, cli, pb):
    """`chunkserve generate`'s sampling flags are made from the sampling table: one per
    SamplingParams field the sampler takes, named as the proto field with dashes, with the
    table's default; a bad value is refused naming the field; a seed reproduces."""
    import json
    out = subprocess.run([str(chunkserve_bin), "generate", "--help-json"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    flags = {e["name"]: e for e in json.loads(out)}
    sampler_fields = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                      "presence_penalty", "frequency_penalty", "seed"]
    proto_fields = {f.name for f in pb.generation_pb2.SamplingParams.DESCRIPTOR.fields}
    for f in sampler_fields:
        assert f in proto_fields, f
        name = f.replace("_", "-")
        assert name in flags, f"no --{name} flag"
        want = "1" if f in ("top_p", "repetition_penalty") else "0"
        assert flags[name]["default"] == want, (name, flags[name])
    bad = subprocess.run([str(chunkserve_bin), "generate", "--model", str(cli.model), "--prompt",
                          "Hi", "--max-tokens", "2", "--top-p", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "top_p" in bad.stderr, bad.stderr[-500:]
    args = ["--prompt", "Once upon a time", "--max-tokens", "12", "--ignore-eos", "--temperature",
            "0.9", "--top-k", "40", "--min-p", "0.02", "--presence-penalty", "0.5"]
    a = cli.run("generate", *args, "--seed", "7")
    b = cli.run("generate", *args, "--seed", "7")
    c = cli.run("generate", *args, "--seed", "-1")  # 2^64 - 1
    assert a == b
    assert a != c or cli.run("generate", *args, "--seed", "8") != a


SPEC_PROMPTS = [
    # code editing: the answer repeats most of the prompt
    "Rename the variable total to sum in this function and print the result:\n"
    "def add_all(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
    "    return total\n\nAnswer:\ndef add_all(values):\n",
    # summarization of a text with repeated phrases
    "The cat sat on the mat. The cat was happy on the mat. The dog saw the cat on the mat. "
    "Summarize: The cat",
    "Once upon a time",
]


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_speculation_is_byte_identical(chunkserve_bin, model_path, pb, mode):
    """`--speculative ngram`, and `draft:PATH` (a draft model: the model itself here, the
    only one with its vocabulary that CI has; seeded requests reject some of its drafts):
    every token, text and logprob (bits) of greedy and seeded requests, sent together so
    decodes and drafts share steps, equals serve without it; the spec_decode counters show
    drafts verified and some kept; GetStatus names the mode; a request that opts out drafts
    nothing."""
    g = pb.generation_pb2
    plain = Server(chunkserve_bin, model_path, pb, "--threads", "2")
    spec = Server(chunkserve_bin, model_path, pb, "--threads", "2", "--speculative",
                  "ngram" if mode == "ngram" else f"draft:{model_path}",
                  "--num-speculative-tokens", "6")
    http = spec.proc.stdout.readline().decode().split()[-1]
    try:
        reqs = []
        for i, p in enumerate(SPEC_PROMPTS):
            reqs.append(g.GenerateRequest(prompt=p, sampling=params(
                pb, max_tokens=48, logprobs=True, top_logprobs=3)))
            reqs.append(g.GenerateRequest(prompt=p, sampling=params(
                pb, max_tokens=48, temperature=0.7, top_p=0.9, seed=11 + i, logprobs=True,
                top_logprobs=2, repetition_penalty=1.1)))
            reqs.append(g.GenerateRequest(prompt=p, sampling=params(
                pb, max_tokens=48, stop=["\n\n"], include_special=False)))

        def run_all(s):
            with ThreadPoolExecutor(len(reqs)) as ex:
                return list(ex.map(lambda r: collect(s.stub.Generate(r, timeout=120)), reqs))

        st, pst = spec.status(), plain.status()
        assert (st.speculative, st.num_speculative_tokens) == (mode, 6)
        assert (pst.speculative, pst.num_speculative_tokens) == ("off", 0)
        want, got = run_all(plain), run_all(spec)
        for r, (wi, wt, wm), (gi, gt, gm) in zip(reqs, want, got):
            assert gi == wi and gt == wt, (r.prompt[:30], wi, gi)
            wl = [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs])
                  for m in wm for lp in m.logprobs]
            gl = [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs])
                  for m in gm for lp in m.logprobs]
            assert gl == wl
            assert gm[-1].finish_reason == wm[-1].finish_reason
        from cluster_harness import spec_counters

        def counters():
            return spec_counters(http)
        vals = counters()
        drafts = vals["chunkserve:spec_decode_num_drafts_total"]
        drafted = vals["chunkserve:spec_decode_num_draft_tokens_total"]
        kept = vals["chunkserve:spec_decode_num_accepted_tokens_total"]
        assert drafts > 0 and 0 < kept <= drafted, vals
        # a request that opts out drafts nothing and gets the same tokens
        r = g.GenerateRequest(prompt=SPEC_PROMPTS[0], sampling=params(
            pb, max_tokens=48, disable_speculation=True))
        assert collect(spec.stub.Generate(r, timeout=120))[0] == want[0][0]
        assert counters() == vals
    finally:
        plain.stop()
        spec.stop()


def test_self_draft_keeps_every_greedy_draft(chunkserve_bin, model_path, pb):
    """The model drafting for itself (`--speculative-always`, so the cost rule cannot turn
    it off), four greedy streams sharing steps: every draft proposed is the token the target
    then picks, so every one is kept. Byte-identical output cannot show a drafter that
    proposes from the wrong KV (verification corrects it); this can."""
    g = pb.generation_pb2
    spec = Server(chunkserve_bin, model_path, pb, "--threads", "2", "--speculative",
                  f"draft:{model_path}", "--num-speculative-tokens", "4",
                  "--speculative-always")
    http = spec.proc.stdout.readline().decode().split()[-1]
    try:
        reqs = [g.GenerateRequest(prompt=p, sampling=params(pb, max_tokens=40, ignore_eos=True))
                for p in SPEC_PROMPTS]
        with ThreadPoolExecutor(len(reqs)) as ex:
            outs = list(ex.map(lambda r: collect(spec.stub.Generate(r, timeout=120)), reqs))
        assert all(len(ids) == 40 for ids, _, _ in outs)
        from cluster_harness import spec_counters
        vals = spec_counters(http)
        drafted = vals["chunkserve:spec_decode_num_draft_tokens_total"]
        kept = vals["chunkserve:spec_decode_num_accepted_tokens_total"]
        assert drafted > 0 and kept == drafted, vals
    finally:
        spec.stop()


def test_speculation_bad_arguments(chunkserve_bin, model_path, named_model):
    qwen = named_model("qwen2.5-coder-0.5b")
    for args, says in ((["--speculative", "ngram", "--num-speculative-tokens", "0"],
                        "num-speculative-tokens"),
                       (["--speculative", "ngram", "--num-speculative-tokens", "100"],
                        "num-speculative-tokens"),
                       (["--speculative", "draft:/nonexistent/d.gguf"],
                        "--speculative draft:/nonexistent/d.gguf: "),
                       (["--speculative", "draft:"], "needs the draft model's path"),
                       # another vocabulary: refused at start, naming both models
                       (["--speculative", f"draft:{qwen}"],
                        "the draft model 'Qwen2.5 Coder 0.5B Instruct AWQ' (qwen2, a vocabulary "
                        "of 151936 tokens) and the target 'Smollm2 135M 8k Lc100K Mix1 Ep2' "
                        "(llama, 49152 tokens) do not share a vocabulary"),
                       (["--speculative", "medusa"], "off, ngram or draft:PATH"),
                       (["--speculative-always"], "--speculative-always: needs --speculative")):
        p = subprocess.run([str(chunkserve_bin), "serve", "--model", str(model_path), "--port", "0",
                            *args], capture_output=True, text=True, timeout=60)
        assert p.returncode != 0 and says in p.stderr, (args, p.stderr[-500:])
    # generate decodes one token a step: the flag is refused there, not ignored
    p = subprocess.run([str(chunkserve_bin), "generate", "--model", str(model_path), "--prompt",
                        "hi", "--max-tokens", "2", "--speculative", "ngram"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--speculative is for serve" in p.stderr, p.stderr[-500:]
