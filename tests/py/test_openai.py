"""The OpenAI-compatible HTTP API (openai/) with the official `openai` client
(max_retries=0) against `chunkserve serve` and against a real router + workers.

Reference answers come from the gRPC door of the same process (grpcio stubs) and from
`chunkserve generate`: greedy text must be equal token for token. Errors must arrive as the
client's matching exception class with OpenAI's error body (type, param, code). Raw-socket
cases check what the client library hides: status lines, headers, SSE framing.
"""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
openai = pytest.importorskip("openai")
pytest.importorskip("grpc_tools.protoc")  # stubs: conftest.proto_modules

from cluster_harness import Proc, make_tiny, metric, wait_for, worker_status  # noqa: E402

QUESTION = "What is the capital of France? Answer in one short sentence."
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def pb(proto_modules):
    return type("PB", (), proto_modules)


class Serve:
    """`chunkserve serve` with its OpenAI port: a gRPC stub, an `openai` client, the HTTP
    address for raw requests."""

    def __init__(self, exe: Path, model: Path, pb, *args, api_key=None):
        self.pb = pb
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [str(exe), "serve", "--model", str(model), "--port", "0", "--openai-port", "0",
             "--threads", "1", "--kv-cache-mib", "64", *args],
            stdout=subprocess.PIPE, stderr=self.err)
        lines = [self.proc.stdout.readline().decode().strip() for _ in range(3)]
        if not lines[2].startswith("openai listening on "):
            self.proc.kill()
            pytest.fail(f"unexpected start lines {lines!r}; stderr: {self.stderr()[-3000:]}")
        self.addr = lines[0].split()[-1]
        self.ops = lines[1].split()[-1]
        self.http = lines[2].split()[-1]
        self.channel = grpc.insecure_channel(self.addr)
        self.stub = pb.generation_pb2_grpc.GenerationStub(self.channel)
        self.worker = pb.cluster_pb2_grpc.WorkerStub(self.channel)
        self.client = openai.OpenAI(base_url=f"http://{self.http}/v1", api_key=api_key or "none",
                                    max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id if not api_key else None

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")

    def status(self):
        return self.worker.GetStatus(self.pb.cluster_pb2.WorkerStatusRequest(), timeout=10)

    def stop(self, timeout=30.0):
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        err = self.stderr()
        assert rc == 0 and "Sanitizer" not in err and "runtime error:" not in err, err[-3000:]


@pytest.fixture(scope="module")
def real(chunkserve_bin, model_path, pb):
    s = Serve(chunkserve_bin, model_path, pb)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tiny_model(bin_dir, tmp_path_factory):
    if not (bin_dir / "chunkserve-mktiny").is_file():
        pytest.skip("chunkserve-mktiny not built")
    return make_tiny(bin_dir, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(chunkserve_bin, tiny_model, pb):
    s = Serve(chunkserve_bin, tiny_model, pb, "--max-queue", "64")
    yield s
    s.stop()


def grpc_generate(s, **kw):
    """(ids, text, finish, usage, logprobs) of one gRPC Generate."""
    ids, text, fin, usage, lps = grpc_generate_top(s, **kw)
    return ids, text, fin, usage, [(i, lp) for i, lp, _ in lps]


def grpc_generate_top(s, **kw):
    """As grpc_generate, with logprobs as (id, logprob, [(alt id, alt logprob)])."""
    g = s.pb.generation_pb2
    sampling = kw.pop("sampling", {})
    msgs = list(s.stub.Generate(g.GenerateRequest(**kw, sampling=g.SamplingParams(**sampling)),
                                timeout=120))
    return ([t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs),
            msgs[-1].finish_reason, msgs[-1].usage,
            [(lp.token_id, lp.logprob, [(a.token_id, a.logprob) for a in lp.top_logprobs])
             for m in msgs for lp in m.logprobs])


def token_texts(s, ids):
    g = s.pb.generation_pb2
    return [s.stub.Detokenize(g.DetokenizeRequest(ids=[i], include_special=True),
                              timeout=30).text for i in ids]


def chat_input(s, content):
    g = s.pb.generation_pb2
    return g.Chat(messages=[g.ChatMessage(role="user", content=content)])


# ------------------------------------------------------------ models --


def test_models(real):
    ms = real.client.models.list()
    assert len(ms.data) == 1 and ms.data[0].object == "model"
    m = real.client.models.retrieve(ms.data[0].id)
    assert m.id == ms.data[0].id
    with pytest.raises(openai.NotFoundError) as e:
        real.client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


# ------------------------------------------------ answers equal gRPC --


def test_chat_greedy_equals_grpc_and_cli(real, cli):
    r = real.client.chat.completions.create(
        model=real.model, messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=24)
    ids, text, finish, usage, _ = grpc_generate(real, chat=chat_input(real, QUESTION),
                                                sampling=dict(max_tokens=24))
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == text
    assert c.finish_reason == ("length" if finish == 2 else "stop")
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == usage.prompt_tokens
    assert r.usage.completion_tokens == usage.completion_tokens == len(ids)
    assert r.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    out = cli.run("generate", "--chat", "--prompt", QUESTION, "--max-tokens", "24").decode()
    assert out.rstrip("\n") == text.rstrip("\n") or out.startswith(text)


def test_completion_greedy_equals_grpc(real):
    r = real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                       max_tokens=20)
    ids, text, _, usage, _ = grpc_generate(real, prompt=PROMPT, sampling=dict(max_tokens=20))
    assert r.object == "text_completion"
    assert r.choices[0].text == text
    assert r.usage.completion_tokens == len(ids) and r.usage.prompt_tokens == usage.prompt_tokens


def test_completion_default_max_tokens_is_16(real):
    r = real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_token_id_prompts_and_batches(real):
    g = real.pb.generation_pb2
    ids = list(real.stub.Tokenize(g.TokenizeRequest(text=PROMPT), timeout=30).ids)
    a = real.client.completions.create(model=real.model, prompt=ids, temperature=0, max_tokens=8)
    b = real.client.completions.create(model=real.model, prompt=[PROMPT, PROMPT],
                                       temperature=0, max_tokens=8)
    assert [c.index for c in b.choices] == [0, 1]
    assert a.choices[0].text == b.choices[1].text
    assert b.usage.prompt_tokens == 2 * a.usage.prompt_tokens


def test_stream_equals_non_stream(real):
    kw = dict(model=real.model, messages=[{"role": "user", "content": QUESTION}], temperature=0,
              max_tokens=24)
    full = real.client.chat.completions.create(**kw)
    chunks = list(real.client.chat.completions.create(**kw, stream=True,
                                                      stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        full.choices[0].message.content
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        full.usage.completion_tokens
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].text for c in real.client.completions.create(
        model=real.model, prompt=PROMPT, temperature=0, max_tokens=20, stream=True))
    assert text == real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                                  max_tokens=20).choices[0].text


def test_n_with_seed_reproducible_and_distinct(real):
    kw = dict(model=real.model, messages=[{"role": "user", "content": "Tell me a story."}],
              temperature=1.0, max_tokens=16, n=3, seed=1234)
    a = real.client.chat.completions.create(**kw)
    b = real.client.chat.completions.create(**kw)
    ta = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert ta == [c.message.content for c in b.choices]
    assert len(set(ta)) >= 2, ta
    assert a.usage.completion_tokens <= 48
    # choice i is the request with seed + i, alone
    one = real.client.chat.completions.create(**{**kw, "n": 1, "seed": 1235})
    assert one.choices[0].message.content == ta[1]


def test_finish_reasons(real):
    r = real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                       max_tokens=1)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 1
    full = real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                          max_tokens=20).choices[0].text
    word = full.split()[1]
    r = real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                       max_tokens=20, stop=[word])
    assert r.choices[0].finish_reason == "stop" and word not in r.choices[0].text


def test_logprobs_equal_grpc(real):
    r = real.client.chat.completions.create(
        model=real.model, messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=8, logprobs=True)
    _, _, _, _, lps = grpc_generate(real, chat=chat_input(real, QUESTION),
                                    sampling=dict(max_tokens=8, logprobs=True))
    got = [(e.token, e.logprob) for e in r.choices[0].logprobs.content]
    assert len(got) == len(lps) == 8
    assert [round(x[1], 5) for x in got] == [round(x[1], 5) for x in lps]
    g = real.pb.generation_pb2
    for (tok, _), (tid, _) in zip(got, lps):
        t = real.stub.Detokenize(g.DetokenizeRequest(ids=[tid], include_special=True), timeout=30)
        assert tok == t.text
    c = real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                       max_tokens=5, logprobs=0)
    assert len(c.choices[0].logprobs.token_logprobs) == 5
    assert "".join(c.choices[0].logprobs.tokens) == c.choices[0].text
    assert c.choices[0].logprobs.top_logprobs is None


def test_top_logprobs_equal_grpc(real):
    """top_logprobs: the 5 most likely tokens at each position, most likely first, under
    the raw distribution (sampling settings do not change them), equal to the gRPC path's."""
    msgs = [{"role": "user", "content": QUESTION}]
    r = real.client.chat.completions.create(model=real.model, messages=msgs, temperature=0.8,
                                            seed=3, max_tokens=6, logprobs=True, top_logprobs=5)
    ids, _, _, _, lps = grpc_generate_top(
        real, chat=chat_input(real, QUESTION),
        sampling=dict(max_tokens=6, temperature=0.8, seed=3, logprobs=True, top_logprobs=5))
    content = r.choices[0].logprobs.content
    assert len(content) == len(lps) == 6
    for e, (tid, lp, alts) in zip(content, lps):
        assert len(e.top_logprobs) == len(alts) == 5
        assert [round(a.logprob, 5) for a in e.top_logprobs] == [round(x, 5) for _, x in alts]
        assert [a.token for a in e.top_logprobs] == token_texts(real, [i for i, _ in alts])
        assert all(x >= y for (_, x), (_, y) in zip(alts, alts[1:]))
        assert lp <= alts[0][1] + 1e-6
        if tid in [i for i, _ in alts]:  # the chosen token's entry has the same value
            assert [x for i, x in alts if i == tid][0] == lp
    # greedy: the chosen token is the first alternative, every time
    _, _, _, _, g = grpc_generate_top(real, prompt=PROMPT, sampling=dict(
        max_tokens=8, logprobs=True, top_logprobs=3))
    assert all(tid == alts[0][0] and lp == alts[0][1] for tid, lp, alts in g)
    # completions: logprobs=N is N alternatives per token, as {text: logprob}
    c = real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                       max_tokens=8, logprobs=3)
    tops = c.choices[0].logprobs.top_logprobs
    assert len(tops) == 8
    for t, tok, (_, lp, alts) in zip(tops, c.choices[0].logprobs.tokens, g):
        assert 1 <= len(t) <= 3 and round(t[tok], 5) == round(lp, 5)
        assert max(t.values()) == t[tok]
    # the stream carries the same alternatives
    s = [e for ch in real.client.chat.completions.create(
            model=real.model, messages=msgs, temperature=0.8, seed=3, max_tokens=6,
            logprobs=True, top_logprobs=5, stream=True)
         if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [[a.logprob for a in e.top_logprobs] for e in s] == \
        [[a.logprob for a in e.top_logprobs] for e in content]


def test_min_tokens(real):
    """min_tokens: end-of-generation, stop ids and stop strings wait until it is reached;
    the same tokens over gRPC; more than max_tokens is a 400."""
    msgs = [{"role": "user", "content": "Say yes."}]
    free = real.client.chat.completions.create(model=real.model, messages=msgs, temperature=0,
                                               max_tokens=200)
    assert free.choices[0].finish_reason == "stop"
    n = free.usage.completion_tokens  # the end-of-generation token included
    r = real.client.chat.completions.create(model=real.model, messages=msgs, temperature=0,
                                            max_tokens=200, extra_body={"min_tokens": n + 10})
    assert r.usage.completion_tokens >= n + 10
    assert r.choices[0].message.content.startswith(free.choices[0].message.content)
    ids, text, _, usage, _ = grpc_generate(real, chat=chat_input(real, "Say yes."),
                                           sampling=dict(max_tokens=200, min_tokens=n + 10))
    assert text == r.choices[0].message.content
    assert usage.completion_tokens == r.usage.completion_tokens
    # a stop string inside the first min_tokens tokens does not end it
    word = free.choices[0].message.content.split()[0]
    s = real.client.chat.completions.create(model=real.model, messages=msgs, temperature=0,
                                            max_tokens=n + 20, stop=[word],
                                            extra_body={"min_tokens": n + 10})
    assert word in s.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        real.client.chat.completions.create(model=real.model, messages=msgs, max_tokens=5,
                                            extra_body={"min_tokens": 6})
    assert e.value.body["param"] == "min_tokens"


# ------------------------------------------------------------ errors --


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=3), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(n=17), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(presence_penalty=5), "presence_penalty"),
    (dict(extra_body={"tools": [{"type": "function", "function": {"name": "f g"}}]}), "tools"),
    (dict(extra_body={"logit_bias": {"5": 101}}), "logit_bias"),
    (dict(extra_body={"logit_bias": {"five": 1}}), "logit_bias"),
    (dict(extra_body={"logit_bias": {str(10 ** 8): 1}}), "logit_bias"),
    (dict(extra_body={"top_k": 1.5}), "top_k"),
    (dict(extra_body={"stop_token_ids": [10 ** 9]}), "stop_token_ids"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(extra_body={"min_tokens": -1}), "min_tokens"),
])
def test_bad_params_are_400_naming_the_field(tiny, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client.chat.completions.create(model=tiny.model,
                                            messages=[{"role": "user", "content": "hi"}], **kw)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error"
    assert e.value.body["param"] == param, e.value.body


def test_bad_messages(tiny):
    for msgs, param in [([], "messages"), ([{"role": "wizard", "content": "x"}], "messages[0].role"),
                        ([{"role": "user", "content": [{"type": "image_url"}]}],
                         "messages[0].content[0]"),
                        ([{"role": "user"}], "messages[0].content")]:
        with pytest.raises(openai.BadRequestError) as e:
            tiny.client.chat.completions.create(model=tiny.model, messages=msgs)
        assert e.value.body["param"] == param, (msgs, e.value.body)


def test_bad_prompts(tiny):
    """A list of prompts must keep the first entry's kind; the error names the entry (the
    lists parsed before it are freed: the ASan run of this file checks for leaks)."""
    for prompt, param in [([[1, 2, 3], 4, [5]], "prompt[1]"), (["a", [1]], "prompt[1]"),
                          ([[1, -2]], "prompt[0]"), ([], "prompt")]:
        with pytest.raises(openai.BadRequestError) as e:
            tiny.client.completions.create(model=tiny.model, prompt=prompt, max_tokens=2)
        assert e.value.body["param"] == param, (prompt, e.value.body)


def test_unknown_model_is_404(tiny):
    with pytest.raises(openai.NotFoundError) as e:
        tiny.client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_context_length_exceeded(tiny):
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client.completions.create(model=tiny.model, prompt=[5] * 5000, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"


def test_text_parts_and_developer_role(tiny):
    a = tiny.client.chat.completions.create(
        model=tiny.model, temperature=0, max_tokens=6,
        messages=[{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Hello "},
                                               {"type": "text", "text": "there"}]}])
    b = tiny.client.chat.completions.create(
        model=tiny.model, temperature=0, max_tokens=6,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hello there"}])
    assert a.choices[0].message.content == b.choices[0].message.content


def raw(addr, data: bytes, timeout=10.0) -> bytes:
    """Sends data on a fresh connection; everything the server answers until it closes or
    goes quiet for a second."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        s.settimeout(1.0)
        out = b""
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                out += b
        except socket.timeout:
            pass
        return out


def post(path, body: bytes, extra=b""):
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + extra + b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
            + body)


@pytest.mark.parametrize("body, fragment", [
    (b"{", "not valid JSON"),
    (b"[1]", "JSON object"),
    (b'{"model": "x", "model": "y", "messages": []}', "twice"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}', "integer"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e300}', "integer"),
    (b'{"messages": [{"role": "user", "content": "x"}], "seed": 1e16}', "integer"),
    (b'{"messages": [{"role": "user", "content": "x"}]} x', "after its JSON"),
])
def test_json_guards(tiny, body, fragment):
    out = raw(tiny.http, post("/v1/chat/completions", body))
    head, _, rest = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), out[:300]
    err = json.loads(rest)["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error", err


def test_http_statuses(tiny):
    out = raw(tiny.http, b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 405") and b"Allow: POST" in out
    out = raw(tiny.http, b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 404") and b'"error"' in out
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    out = raw(tiny.http, post("/v1/completions", big))
    assert out.startswith(b"HTTP/1.1 413"), out[:200]
    out = raw(tiny.http, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40000 +
              b"\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 431"), out[:200]
    out = raw(tiny.http, b"BLAH\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400")


def test_chunked_body_and_expect_continue(tiny):
    body = json.dumps({"model": tiny.model, "prompt": "hello", "max_tokens": 3,
                       "temperature": 0}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:10], body[10:])) + b"0\r\n\r\n"
    out = raw(tiny.http, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
              b"Connection: close\r\n\r\n" + chunked)
    assert out.startswith(b"HTTP/1.1 200"), out[:300]
    host, port = tiny.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(body)
        out = b""
        while (b := s.recv(65536)):
            out += b
    assert b"HTTP/1.1 200" in out and b"text_completion" in out


def test_sse_framing_and_pipelining(tiny):
    body = json.dumps({"model": tiny.model, "prompt": "hello", "max_tokens": 4, "temperature": 0,
                       "stream": True}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
           + body)
    out = raw(tiny.http, req + req + b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.count(b"HTTP/1.1 200") == 3, out[:500]
    assert b"text/event-stream" in out and out.count(b"data: [DONE]") == 2
    first = out.index(b"data: [DONE]")
    assert out.index(b"HTTP/1.1 200", 1) > first  # responses in request order


def test_api_keys_both_doors(chunkserve_bin, tiny_model, pb, tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# team keys\nsecond-key-0123\n")
    s = Serve(chunkserve_bin, tiny_model, pb, "--api-key", "first-key-0123",
              "--api-key", "third-key-0123", "--api-key-file", str(keyfile),
              api_key="wrong-key-0123")
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            s.client.models.list()
        assert e.value.status_code == 401
        for key in ("first-key-0123", "second-key-0123", "third-key-0123"):
            c = openai.OpenAI(base_url=f"http://{s.http}/v1", api_key=key, max_retries=0)
            m = c.models.list().data[0].id
            r = c.completions.create(model=m, prompt="hi", max_tokens=2)
            assert r.usage.completion_tokens >= 1
        out = raw(s.http, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 401") and b"WWW-Authenticate: Bearer" in out
        g = pb.generation_pb2
        with pytest.raises(grpc.RpcError) as e:
            list(s.stub.Generate(g.GenerateRequest(prompt="hi"), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            s.stub.ListModels(g.ListModelsRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = list(s.stub.Generate(g.GenerateRequest(prompt="hi", sampling=g.SamplingParams(max_tokens=2)),
                                  timeout=10, metadata=[("authorization", "Bearer first-key-0123")]))
        assert ok[-1].finish_reason
        assert not any(k in s.stderr() for k in ("first-key", "second-key", "third-key"))
    finally:
        s.stop()


def test_cors(chunkserve_bin, tiny_model, pb, tiny):
    s = Serve(chunkserve_bin, tiny_model, pb, "--cors-allow-origins", "https://a.example")
    try:
        out = raw(s.http, b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Origin: https://a.example\r\nAccess-Control-Request-Method: POST\r\n"
                  b"Connection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 204") and b"Access-Control-Allow-Origin: https://a.example" in out
        # the official JS SDK's preflight: its x-stainless-* headers are allowed
        out = raw(s.http, b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Origin: https://a.example\r\nAccess-Control-Request-Method: POST\r\n"
                  b"Access-Control-Request-Headers: authorization, content-type, "
                  b"x-stainless-os, x-stainless-lang, x-stainless-retry-count\r\n"
                  b"Connection: close\r\n\r\n")
        allowed = [ln for ln in out.split(b"\r\n") if ln.startswith(b"Access-Control-Allow-Headers:")]
        assert allowed and all(h in allowed[0] for h in
                               (b"x-stainless-os", b"x-stainless-lang", b"Authorization")), out
        out = raw(s.http, b"OPTIONS /tokenize HTTP/1.1\r\nHost: x\r\n"
                  b"Origin: https://a.example\r\nAccess-Control-Request-Method: POST\r\n"
                  b"Connection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 204"), out
        out = raw(s.http, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nOrigin: https://b.example\r\n"
                  b"Connection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 200") and b"Access-Control-Allow-Origin" not in out
    finally:
        s.stop()
    # without --cors-allow-origins there is no CORS: a preflight is an unknown method
    out = raw(tiny.http, b"OPTIONS /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 405")


# -------------------------------------------- every field: served or refused --

DOCS = Path(__file__).resolve().parents[2] / "docs" / "openai.md"


def refused_fields():
    """(field, door) of every row of docs/openai.md's "Refused by name" table."""
    text = DOCS.read_text().split("### Refused by name", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            out.append((name, cells[1]))
    return out


@pytest.mark.parametrize("name, door", refused_fields())
def test_refused_fields_are_400_naming_them(tiny, name, door):
    """Every field the docs list as refused is refused by name when it asks for something,
    on its door (the docs and openai/request.c keep one list)."""
    value = {"anything": 1}
    if door == "completions":
        with pytest.raises(openai.BadRequestError) as e:
            tiny.client.completions.create(model=tiny.model, prompt="hi", max_tokens=2,
                                           extra_body={name: value})
    else:
        with pytest.raises(openai.BadRequestError) as e:
            tiny.client.chat.completions.create(model=tiny.model, max_tokens=2,
                                                messages=[{"role": "user", "content": "hi"}],
                                                extra_body={name: value})
    assert e.value.body["param"] == name, e.value.body


def test_default_values_of_refused_fields_are_accepted(tiny):
    """response_format {"type": "text"} (the default; cJSON's prev of a lone key is itself,
    never NULL, which once made this a 400), best_of 1, empty tools, null logit_bias."""
    r = tiny.client.chat.completions.create(
        model=tiny.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        response_format={"type": "text"}, tools=[],
        extra_body={"logit_bias": None, "prompt_logprobs": None,
                    "spaces_between_special_tokens": True})
    assert r.choices[0].finish_reason
    tiny.client.completions.create(model=tiny.model, prompt="hi", max_tokens=2, best_of=1)
    with pytest.raises(openai.BadRequestError) as e:  # a refused type names the field
        tiny.client.chat.completions.create(model=tiny.model, max_tokens=2,
                                            messages=[{"role": "user", "content": "hi"}],
                                            response_format={"type": "xml"})
    assert e.value.body["param"] == "response_format"


def test_unknown_fields_are_400(tiny):
    for create, kw in [(tiny.client.chat.completions.create,
                        dict(messages=[{"role": "user", "content": "hi"}])),
                       (tiny.client.completions.create, dict(prompt="hi"))]:
        with pytest.raises(openai.BadRequestError) as e:
            create(model=tiny.model, max_tokens=2, extra_body={"frobnicate": 1}, **kw)
        assert e.value.body["param"] == "frobnicate"
        assert "Unrecognized request argument" in e.value.body["message"]
    # a chat-only field on completions is unknown there
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client.completions.create(model=tiny.model, prompt="hi", max_tokens=2,
                                       extra_body={"messages": []})
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client.chat.completions.create(
            model=tiny.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            stream=True, stream_options={"include_usage": True, "bogus": True})
    assert e.value.body["param"] == "stream_options"


def test_out_of_vocabulary_prompt_names_prompt(tiny):
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client.completions.create(model=tiny.model, prompt=[1, 10 ** 6], max_tokens=2)
    assert e.value.body["param"] == "prompt", e.value.body


def test_max_tokens_beyond_the_context_is_context_length_exceeded(tiny):
    """vLLM's rule, on both doors: prompt + max_tokens must fit the context."""
    ctx = tiny.client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client.completions.create(model=tiny.model, prompt=[5] * 10, max_tokens=ctx - 9)
    assert e.value.body["code"] == "context_length_exceeded", e.value.body
    assert e.value.body["param"] == "prompt"
    r = tiny.client.completions.create(model=tiny.model, prompt=[5] * 10, max_tokens=ctx - 10,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == ctx - 10
    g = tiny.pb.generation_pb2
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(tiny, token_ids=g.TokenIds(ids=[5] * 10), sampling=dict(max_tokens=ctx))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in e.value.details()


def test_models_created_and_root(tiny):
    m = tiny.client.models.list().data[0]
    assert abs(m.created - time.time()) < 3600 and m.model_extra["root"] == m.id
    assert m.model_extra["parent"] is None


def test_health_version_tokenize_detokenize(real):
    base = f"http://{real.http}"
    import urllib.request

    def call(path, body=None):
        req = urllib.request.Request(base + path, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as f:
            return f.status, f.read()

    assert call("/health") == (200, b"")
    assert "version" in json.loads(call("/version")[1])
    t = json.loads(call("/tokenize", {"prompt": PROMPT})[1])
    r = real.client.completions.create(model=real.model, prompt=PROMPT, max_tokens=1)
    assert t["count"] == len(t["tokens"]) == r.usage.prompt_tokens
    assert t["max_model_len"] > 0
    assert json.loads(call("/detokenize", {"tokens": t["tokens"]})[1])["prompt"].endswith(PROMPT)
    msgs = [{"role": "user", "content": QUESTION}]
    c = json.loads(call("/tokenize", {"messages": msgs})[1])
    r = real.client.chat.completions.create(model=real.model, messages=msgs, max_tokens=1)
    assert c["count"] == r.usage.prompt_tokens
    closed = json.loads(call("/tokenize", {"messages": msgs, "add_generation_prompt": False})[1])
    assert closed["tokens"] == c["tokens"][:closed["count"]] and closed["count"] < c["count"]
    with pytest.raises(urllib.error.HTTPError) as e:
        call("/detokenize", {"tokens": [10 ** 7]})
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == "tokens"


def test_chat_endings_continue_final_message(real):
    """add_generation_prompt false / continue_final_message: the same rendering through
    /tokenize, the OpenAI door and gRPC's Chat.end; the model continues the open message."""
    g = real.pb.generation_pb2
    msgs = [{"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "The color I like best is"}]
    a = real.client.chat.completions.create(
        model=real.model, messages=msgs, temperature=0, max_tokens=8,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    chat = g.Chat(messages=[g.ChatMessage(**m) for m in msgs], end=g.CHAT_END_CONTINUE)
    ids, text, _, usage, _ = grpc_generate(real, chat=chat, sampling=dict(max_tokens=8))
    assert a.choices[0].message.content == text and a.usage.prompt_tokens == usage.prompt_tokens
    closed = real.client.chat.completions.create(
        model=real.model, messages=msgs, temperature=0, max_tokens=8,
        extra_body={"add_generation_prompt": False})
    assert closed.usage.prompt_tokens > a.usage.prompt_tokens  # the closing marker
    with pytest.raises(openai.BadRequestError) as e:
        real.client.chat.completions.create(
            model=real.model, messages=msgs, max_tokens=2,
            extra_body={"continue_final_message": True, "add_generation_prompt": True})
    assert e.value.body["param"] == "continue_final_message"


def test_echo(real):
    plain = real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                           max_tokens=10)
    echo = real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                          max_tokens=10, echo=True)
    assert echo.choices[0].text == PROMPT + plain.choices[0].text
    s = "".join(c.choices[0].text for c in real.client.completions.create(
        model=real.model, prompt=PROMPT, temperature=0, max_tokens=10, echo=True, stream=True)
        if c.choices)
    assert s == echo.choices[0].text
    ids = json.loads(urllib_post(real, "/tokenize", {"prompt": PROMPT}))["tokens"]
    t = real.client.completions.create(model=real.model, prompt=ids, temperature=0,
                                       max_tokens=10, echo=True)
    assert t.choices[0].text.endswith(plain.choices[0].text)
    assert PROMPT in t.choices[0].text
    msgs = [{"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "My favourite is"}]
    c = real.client.chat.completions.create(
        model=real.model, messages=msgs, temperature=0, max_tokens=6,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False})
    assert c.choices[0].message.content.startswith("My favourite is")


def plp_first(entry):
    """The prompt token's (id, logprob, rank) of a vLLM prompt_logprobs entry: its first key."""
    k, v = next(iter(entry.items()))
    return int(k), v["logprob"], v["rank"]


def test_prompt_logprobs(real):
    """vLLM's prompt_logprobs: each prompt token's logprob given the tokens before it, from
    the same computation as a generated token's: feeding a greedy answer back as the prompt
    gives its tokens the very logprobs they were generated with (the integer kernels give a
    row the same bits in a prefill chunk and in a decode step). The prompt is computed whole
    (no prefix cache), the alternatives are the most likely tokens ranked 1..k."""
    ids = json.loads(urllib_post(real, "/tokenize", {"prompt": PROMPT}))["tokens"]
    gen = real.client.completions.create(model=real.model, prompt=ids, temperature=0,
                                         max_tokens=8, logprobs=0,
                                         extra_body={"return_tokens_as_token_ids": True})
    gen_ids = [int(t.split(":")[1]) for t in gen.choices[0].logprobs.tokens]
    gen_lps = gen.choices[0].logprobs.token_logprobs
    for _ in range(2):  # the second time the prompt's pages are cached: not used for this
        r = real.client.completions.create(model=real.model, prompt=ids + gen_ids, max_tokens=1,
                                           temperature=0, extra_body={"prompt_logprobs": 3})
        plp = r.choices[0].model_extra["prompt_logprobs"]
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert len(plp) == len(ids) + len(gen_ids) and plp[0] is None
        assert [plp_first(e)[0] for e in plp[1:]] == (ids + gen_ids)[1:]
        assert [plp_first(e)[1] for e in plp[len(ids):]] == gen_lps  # bit for bit
        assert all(plp_first(e)[2] == 1 for e in plp[len(ids):])  # greedy: the likeliest
        for e in plp[1:]:
            # the token first, then the top 3 (the token among them when its rank is <= 3)
            tok, lp, rank = plp_first(e)
            assert rank >= 1 and len(e) == 3 + (rank > 3)
            top = sorted((v["rank"], v["logprob"]) for v in e.values() if v["rank"] <= 3)
            assert [r for r, _ in top] == [1, 2, 3]
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str)
                       for v in e.values())
    # chat: beside the choices, one entry per prompt token
    c = real.client.chat.completions.create(model=real.model, temperature=0, max_tokens=2,
                                            messages=[{"role": "user", "content": PROMPT}],
                                            extra_body={"prompt_logprobs": 0})
    cp = c.model_extra["prompt_logprobs"]
    assert len(cp) == c.usage.prompt_tokens and cp[0] is None and all(len(e) == 1 for e in cp[1:])
    # gRPC: on the first message only, as PromptLogprob entries
    g = real.pb.generation_pb2
    msgs = list(real.stub.Generate(g.GenerateRequest(
        token_ids=g.TokenIds(ids=ids + gen_ids), sampling=g.SamplingParams(
            max_tokens=3, prompt_logprobs=True, prompt_top_logprobs=2)), timeout=120))
    assert [len(m.prompt_logprobs) for m in msgs] == [len(ids) + len(gen_ids) - 1] + [0] * (
        len(msgs) - 1)
    first = msgs[0].prompt_logprobs
    assert [e.token_id for e in first] == (ids + gen_ids)[1:]
    assert [e.logprob for e in first][len(ids) - 1:] == pytest.approx(gen_lps, abs=0)
    assert all(len(e.top_logprobs) == 2 and e.rank >= 1 for e in first)


def test_echo_with_logprobs(real):
    """Completions' echo with logprobs: the prompt's tokens first (the first with a null
    logprob), then the answer's, streamed or not; the prompt's values are its prompt_logprobs."""
    kw = dict(model=real.model, prompt=PROMPT, temperature=0, max_tokens=6, echo=True, logprobs=2)
    r = real.client.completions.create(**kw)
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 6 and r.choices[0].text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert all(1 <= len(d) <= 2 for d in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == r.choices[0].text
    p = real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                       max_tokens=6, extra_body={"prompt_logprobs": 2})
    assert lp.token_logprobs[1:n_prompt] == [plp_first(e)[1] for e in
                                             p.choices[0].model_extra["prompt_logprobs"][1:]]
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in real.client.completions.create(**kw, stream=True):
        if c.choices and c.choices[0].logprobs:
            for k in streamed:
                streamed[k] += getattr(c.choices[0].logprobs, k)
    assert streamed == {k: getattr(lp, k) for k in streamed}


def test_prompt_logprobs_refused(tiny):
    """What is not served is refused by name: the whole vocabulary (-1), more than 20
    alternatives, a streamed answer (as vLLM); gRPC checks its two fields."""
    for body, msg in (({"prompt_logprobs": -1}, "whole vocabulary"),
                      ({"prompt_logprobs": 21}, "[0, 20]"),
                      ({"prompt_logprobs": True}, "integer"),
                      ({"prompt_logprobs": 1, "stream": True}, "stream")):
        with pytest.raises(openai.BadRequestError) as e:
            tiny.client.completions.create(model=tiny.model, prompt="hi", max_tokens=2,
                                           extra_body=body, stream=body.get("stream", False))
        assert e.value.body["param"] == "prompt_logprobs" and msg in e.value.body["message"]
    g = tiny.pb.generation_pb2
    for sp in (dict(prompt_top_logprobs=2), dict(prompt_logprobs=True, prompt_top_logprobs=21)):
        with pytest.raises(grpc.RpcError) as e:
            list(tiny.stub.Generate(g.GenerateRequest(prompt="hi", sampling=g.SamplingParams(
                max_tokens=2, **sp)), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "prompt_top_logprobs" in e.value.details()
    # served on the tiny model too (the ASan run): shapes, n > 1, a one-token prompt
    r = tiny.client.completions.create(model=tiny.model, prompt=[5, 6, 7, 8], max_tokens=3, n=2,
                                       echo=True, logprobs=1, extra_body={"prompt_logprobs": 1})
    for ch in r.choices:
        plp = ch.model_extra["prompt_logprobs"]
        assert plp[0] is None and [plp_first(e)[0] for e in plp[1:]] == [6, 7, 8]
        assert ch.logprobs.token_logprobs[1:4] == [plp_first(e)[1] for e in plp[1:]]
        assert len(ch.logprobs.tokens) == 7
    one = tiny.client.completions.create(model=tiny.model, prompt=[5], max_tokens=2,
                                         extra_body={"prompt_logprobs": 0})
    assert one.choices[0].model_extra["prompt_logprobs"] == [None]


def urllib_post(s, path, body):
    import urllib.request
    req = urllib.request.Request(f"http://{s.http}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as f:
        return f.read()


def test_return_tokens_as_token_ids_and_logprobs_zero(real):
    kw = dict(model=real.model, messages=[{"role": "user", "content": QUESTION}], temperature=0,
              max_tokens=8, logprobs=True, top_logprobs=2)
    a = real.client.chat.completions.create(**kw)
    b = real.client.chat.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True})
    ids = []
    for x, y in zip(a.choices[0].logprobs.content, b.choices[0].logprobs.content):
        assert re.fullmatch(r"token_id:\d+", y.token) and x.logprob == y.logprob
        assert x.bytes == y.bytes
        ids.append(int(y.token.split(":")[1]))
        assert all(re.fullmatch(r"token_id:\d+", t.token) for t in y.top_logprobs)
    text = json.loads(urllib_post(real, "/detokenize", {"tokens": ids}))["prompt"]
    assert text.replace("<|im_end|>", "") == a.choices[0].message.content  # vLLM's: specials kept
    # completions logprobs=0: the sampled token's logprob alone, no alternatives
    r = real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                       max_tokens=5, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 5
    assert lp.top_logprobs is None and all(v <= 0 for v in lp.token_logprobs)


def test_logit_bias(real):
    """-100 bans the greedy first token, +100 forces another; the same through gRPC's two
    lists; logprobs stay the raw distribution's."""
    kw = dict(model=real.model, prompt=PROMPT, temperature=0, max_tokens=4, logprobs=0,
              extra_body={"return_tokens_as_token_ids": True})
    first = lambda r: int(r.choices[0].logprobs.tokens[0].split(":")[1])  # noqa: E731
    a = real.client.completions.create(**kw)
    t0 = first(a)
    b = real.client.completions.create(**{**kw, "extra_body": {
        "return_tokens_as_token_ids": True, "logit_bias": {str(t0): -100}}})
    assert first(b) != t0
    forced = 1234
    c = real.client.completions.create(**{**kw, "extra_body": {
        "return_tokens_as_token_ids": True, "logit_bias": {str(forced): 100}}})
    assert all(int(t.split(":")[1]) == forced for t in c.choices[0].logprobs.tokens)
    assert c.choices[0].logprobs.token_logprobs[0] < -1  # raw: unlikely without the bias
    ids, text, _, _, _ = grpc_generate(real, prompt=PROMPT, sampling=dict(
        max_tokens=4, logit_bias_ids=[t0], logit_bias_values=[-100]))
    assert text == b.choices[0].text and ids[0] == first(b)
    g = real.pb.generation_pb2
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(real, prompt=PROMPT, sampling=dict(max_tokens=2, logit_bias_ids=[1, 2],
                                                         logit_bias_values=[1.0]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pair" in e.value.details()
    del g


def test_new_routes_and_fields_on_the_tiny_model(tiny):
    """The same paths on the tiny model, so the ASan run of this file covers them: /tokenize
    and /detokenize (good and bad bodies), echo of text and token-id prompts, logit_bias,
    token ids as names, chat endings."""
    t = json.loads(urllib_post(tiny, "/tokenize", {"prompt": "hello there"}))
    assert t["count"] == len(t["tokens"]) > 0
    d = json.loads(urllib_post(tiny, "/detokenize", {"tokens": t["tokens"]}))
    assert "hello there" in d["prompt"]
    for path, body, param in [("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
                              ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
                              ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]},
                               "messages[0].role"),
                              ("/detokenize", {"tokens": "x"}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens")]:
        import urllib.error
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib_post(tiny, path, body)
        assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == param
    kw = dict(model=tiny.model, temperature=0, max_tokens=5, echo=True,
              extra_body={"logit_bias": {"7": 2.5}, "ignore_eos": True})
    a = tiny.client.completions.create(prompt="hello there", **kw)
    b = tiny.client.completions.create(prompt=t["tokens"], **kw)
    assert a.choices[0].text.startswith("hello there") and b.choices[0].text.endswith(
        a.choices[0].text[len("hello there"):])
    c = tiny.client.chat.completions.create(
        model=tiny.model, max_tokens=4, logprobs=True, top_logprobs=1,
        messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "echo": True, "return_tokens_as_token_ids": True})
    assert c.choices[0].message.content.startswith("y")
    assert all(x.token.startswith("token_id:") for x in c.choices[0].logprobs.content)


def test_stop_reason(real):
    """vLLM's stop_reason: the stop string or stop token id that ended a choice, null for the
    end-of-generation token and for the length; the same streamed, through gRPC's oneof."""
    free = real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                          max_tokens=16)
    words = free.choices[0].text.split()
    word = words[1] if len(words) > 1 else words[0]
    r = real.client.completions.create(model=real.model, prompt=PROMPT, temperature=0,
                                       max_tokens=16, stop=["zzz-never", word])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == word
    last = [c for c in real.client.completions.create(
        model=real.model, prompt=PROMPT, temperature=0, max_tokens=16, stop=[word], stream=True)
        if c.choices][-1]
    assert last.choices[0].finish_reason == "stop"
    assert last.choices[0].model_extra["stop_reason"] == word
    g = real.pb.generation_pb2
    msgs = list(real.stub.Generate(g.GenerateRequest(prompt=PROMPT, sampling=g.SamplingParams(
        max_tokens=16, stop=[word])), timeout=60))
    assert msgs[-1].WhichOneof("stop_reason") == "stop_string" and msgs[-1].stop_string == word
    kw = dict(model=real.model, prompt=PROMPT, temperature=0, max_tokens=16, logprobs=0,
              extra_body={"return_tokens_as_token_ids": True})
    ids = [int(x.split(":")[1]) for x in real.client.completions.create(**kw).choices[0]
           .logprobs.tokens]
    kw["extra_body"]["stop_token_ids"] = [ids[2]]
    t = real.client.completions.create(**kw)
    assert t.choices[0].model_extra["stop_reason"] == ids[2]
    assert free.choices[0].model_extra["stop_reason"] is None  # length
    c = real.client.chat.completions.create(model=real.model, temperature=0, max_tokens=200,
                                            messages=[{"role": "user", "content": "Say hi."}])
    assert c.choices[0].finish_reason == "stop" and c.choices[0].model_extra["stop_reason"] is None


def test_continuous_usage_stats(tiny):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries
    its choice's counts so far; the prompt count is Generate's, the last equals the usage."""
    for create, kw in [(tiny.client.chat.completions.create,
                        dict(messages=[{"role": "user", "content": "hello there"}])),
                       (tiny.client.completions.create, dict(prompt="hello there", n=2))]:
        chunks = list(create(model=tiny.model, max_tokens=6, temperature=0, stream=True,
                             stream_options={"include_usage": True,
                                             "continuous_usage_stats": True},
                             extra_body={"ignore_eos": True}, **kw))
        final = chunks[-1].usage
        assert not chunks[-1].choices and final.completion_tokens == 6 * kw.get("n", 1)
        seen = {}
        for ch in chunks[:-1]:
            assert ch.usage is not None and ch.usage.prompt_tokens == final.prompt_tokens
            i = ch.choices[0].index
            assert ch.usage.completion_tokens >= seen.get(i, 0)
            seen[i] = ch.usage.completion_tokens
            assert ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens
        assert all(v == 6 for v in seen.values()) and len(seen) == kw.get("n", 1)
        assert chunks[0].usage.prompt_tokens == final.prompt_tokens


def test_request_id_names_the_answer(tiny):
    r = tiny.client.chat.completions.create(model=tiny.model, max_tokens=2,
                                            messages=[{"role": "user", "content": "hi"}],
                                            extra_body={"request_id": "my-req-42"})
    assert r.id == "chatcmpl-my-req-42"
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client.chat.completions.create(model=tiny.model, max_tokens=2,
                                            messages=[{"role": "user", "content": "hi"}],
                                            extra_body={"request_id": "has space"})
    assert e.value.body["param"] == "request_id", e.value.body


# ----------------------------------------------------------- streams --


def test_cache_salt(tiny):
    """vLLM's cache_salt through the official client (extra_body): a prompt is reused from
    the prefix cache only under its own salt; usage.prompt_tokens_details.cached_tokens is
    0 under another; a salt over 256 bytes is a 400 naming it."""
    prompt = [(13 * j) % 300 + 1 for j in range(70)]  # 4 full 16-token pages cacheable

    def cached(salt):
        r = tiny.client.completions.create(model=tiny.model, prompt=prompt, max_tokens=1,
                                           extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens

    assert [cached(s) for s in ("oa-a", "oa-b", "oa-a", "oa-b", "oa-c")] == [0, 0, 64, 64, 0]
    with pytest.raises(openai.BadRequestError) as e:
        cached("x" * 257)
    assert "cache_salt" in str(e.value)


def test_closing_a_stream_frees_every_page(tiny):
    st = tiny.status()
    stream = tiny.client.completions.create(model=tiny.model, prompt="hello", max_tokens=3000,
                                            stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    wait_for(lambda: (lambda s: s.kv_pages_free == s.kv_pages_total and not s.num_running)(
        tiny.status()), 30, "every KV page free after the stream closed")
    assert tiny.status().kv_pages_total == st.kv_pages_total


def test_32_concurrent_streams(tiny):
    want = tiny.client.completions.create(model=tiny.model, prompt="abc", temperature=0,
                                          max_tokens=40).choices[0].text
    out, errs = [None] * 32, []

    def one(i):
        try:
            out[i] = "".join(c.choices[0].text for c in tiny.client.completions.create(
                model=tiny.model, prompt="abc", temperature=0, max_tokens=40, stream=True))
        except Exception as e:  # noqa: BLE001
            errs.append(repr(e))

    ts = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errs and out == [want] * 32


def test_slowloris_and_idle_keep_alive(chunkserve_bin, tiny_model, pb):
    """A client trickling one header byte every 100 ms gets a 408 and is closed once
    --openai-request-timeout-ms has passed since its first byte, while other clients are
    answered; an idle keep-alive connection is closed after --openai-idle-timeout-ms."""
    s = Serve(chunkserve_bin, tiny_model, pb, "--openai-request-timeout-ms", "1000",
              "--openai-idle-timeout-ms", "1500")
    try:
        host, port = s.http.rsplit(":", 1)
        slow = socket.create_connection((host, int(port)), timeout=10)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0, out = time.monotonic(), b""
        while time.monotonic() - t0 < 10:  # far past the deadline
            try:
                slow.sendall(b"X")
            except OSError:
                break  # closed by the server
            assert s.client.models.list().data  # others are served meanwhile
            slow.settimeout(0.1)
            try:
                b = slow.recv(65536)
                out += b
                if not b:
                    break
            except socket.timeout:
                pass
        slow.close()
        assert out.startswith(b"HTTP/1.1 408"), out[:300]
        assert "message" in json.loads(out.partition(b"\r\n\r\n")[2])["error"]
        idle = socket.create_connection((host, int(port)), timeout=10)
        idle.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        first = idle.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        idle.settimeout(10)  # the idle timeout (1.5 s) closes it well before this
        rest = b""
        while (b := idle.recv(65536)):
            rest += b
        assert rest == b""
        idle.close()
    finally:
        s.stop()


def test_queue_full_is_429_with_retry_after(chunkserve_bin, tiny_model, pb):
    s = Serve(chunkserve_bin, tiny_model, pb, "--max-queue", "1", "--max-num-seqs", "1")
    try:
        # one running (--max-num-seqs 1), one waiting (--max-queue 1): the third is refused
        streams = [s.client.completions.create(model=s.model, prompt="x", max_tokens=3000,
                                               stream=True, extra_body={"ignore_eos": True})]
        next(iter(streams[0]))
        body2 = json.dumps({"model": s.model, "prompt": "y", "max_tokens": 3000, "stream": True,
                            "ignore_eos": True}).encode()
        host, port = s.http.rsplit(":", 1)
        waiting = socket.create_connection((host, int(port)), timeout=10)
        waiting.sendall(post("/v1/completions", body2))
        wait_for(lambda: s.status().num_waiting >= 1, 30, "the second request waiting")
        body = json.dumps({"model": s.model, "prompt": "x", "max_tokens": 2}).encode()
        out = raw(s.http, post("/v1/completions", body))
        assert out.startswith(b"HTTP/1.1 429"), out[:300]
        assert b"Retry-After:" in out and b"rate_limit" in out
        # counted as the workers count theirs
        with urllib.request.urlopen(f"http://{s.ops}/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        assert "chunkserve:requests_refused_total 1" in lines, [
            x for x in lines if "refused" in x]
        waiting.close()
        for st in streams:
            st.close()
    finally:
        s.stop()


def test_sigterm_drains_http_streams(chunkserve_bin, tiny_model, pb):
    # a grace far longer than the stream: it takes 0.4 s here, ~25 s in the ASan build
    s = Serve(chunkserve_bin, tiny_model, pb, "--grace-ms", "120000")
    # the tiny model streams ~10k tokens/s on a quiet machine: the longest stream the
    # context allows, and the refusal checked as soon as the signal is handled (no
    # fixed sleep that the stream could outlast)
    stream = s.client.completions.create(model=s.model, prompt="x", max_tokens=4000, stream=True,
                                         extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    s.proc.send_signal(signal.SIGTERM)
    body = json.dumps({"model": s.model, "prompt": "x", "max_tokens": 2}).encode()
    t_end = time.monotonic() + 5
    while True:
        out = raw(s.http, post("/v1/completions", body))
        if not out.startswith(b"HTTP/1.1 200") or time.monotonic() > t_end:
            break
        time.sleep(0.005)  # the signal not handled yet
    assert out.startswith(b"HTTP/1.1 503") and b"Retry-After:" in out, out[:300]
    n = 1 + sum(1 for _ in it)  # the open stream finishes within its grace
    assert n >= 2
    assert s.proc.wait(150) == 0


# ----------------------------------------------------- through a router --


@pytest.fixture
def cluster(bin_dir, tiny_model, pb):
    for b in ("chunkserve-router", "chunkserve-prefill", "chunkserve-decode"):
        if not (bin_dir / b).is_file():
            pytest.skip(f"{b} not built")
    common = [f"--model={tiny_model}", "--port=0", "--threads=1", "--kv-cache-mib=16",
              "--grace-ms=2000"]
    decode = [Proc(bin_dir / "chunkserve-decode", common, f"decode-{i}") for i in range(2)]
    prefill = Proc(bin_dir / "chunkserve-prefill", common, "prefill")
    router = Proc(bin_dir / "chunkserve-router",
                  [f"--model={tiny_model}", "--port=0", "--openai-port=0", "--grace-ms=2000",
                   "--status-interval-ms=100", "--local-prefill-threshold=8",
                   "--decode-workers=" + ",".join(d.addr for d in decode),
                   f"--prefill-workers={prefill.addr}"], "router")
    line = router.proc.stdout.readline().decode().strip()
    assert line.startswith("openai listening on "), line
    router.openai = line.split()[-1]
    wait_for(lambda: metric(router.metrics(), "chunkserve:workers_usable", 'role="decode"') == 2,
             60, "both decode workers usable")
    yield router, decode, prefill
    for p in (router, *decode, prefill):
        rc = p.stop()
        assert rc == (-9 if p.killed else 0), p.stderr()[-3000:]


def test_router_answers_like_serve(cluster, tiny):
    router, _, _ = cluster
    c = openai.OpenAI(base_url=f"http://{router.openai}/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "hello there, how are you today? " * 3}]
    a = c.chat.completions.create(model=tiny.model, messages=msgs, temperature=0, max_tokens=30)
    b = tiny.client.chat.completions.create(model=tiny.model, messages=msgs, temperature=0,
                                            max_tokens=30)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    s = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=tiny.model, messages=msgs, temperature=0, max_tokens=30, stream=True) if ch.choices)
    assert s == b.choices[0].message.content
    assert metric(router.metrics(), "chunkserve:prefills_total", 'path="remote"') >= 1


def test_router_carries_the_tenant(cluster, tiny):
    """The X-Chunkserve-Tenant header through the router to the workers (remote and local
    prefill alike): the answer is serve's; a bad one is refused by name. That the workers
    order by it is test_sched's and test_tenants.py's to show."""
    router, _, _ = cluster
    c = openai.OpenAI(base_url=f"http://{router.openai}/v1", api_key="none", max_retries=0)
    for prompt in ("hello there, how are you today? " * 8, "hi"):  # remote, then local prefill
        kw = dict(model=tiny.model, prompt=prompt, temperature=0, max_tokens=12)
        a = c.completions.create(**kw, extra_headers={"X-Chunkserve-Tenant": "team-a"})
        b = tiny.client.completions.create(**kw)
        assert a.choices[0].text == b.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=tiny.model, prompt="hi", max_tokens=2,
                             extra_headers={"X-Chunkserve-Tenant": "t" * 65})
    assert e.value.body["param"] == "tenant", e.value.body


def test_router_fields_like_serve(cluster, tiny):
    """The new fields and routes answer the same through the router (remote prefill)."""
    router, _, _ = cluster
    c = openai.OpenAI(base_url=f"http://{router.openai}/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "tell me a story " * 4},
            {"role": "assistant", "content": "Once upon a time"}]
    kw = dict(model=tiny.model, messages=msgs, temperature=0, max_tokens=10,
              extra_body={"echo": True, "continue_final_message": True,
                          "add_generation_prompt": False, "request_id": "parity-1",
                          "logit_bias": {"5": 3.5, "17": -2}})
    a, b = c.chat.completions.create(**kw), tiny.client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content.startswith("Once upon a time")
    assert a.id == b.id == "chatcmpl-parity-1"
    for body in ({"prompt": "hello world"}, {"messages": msgs, "continue_final_message": True,
                                             "add_generation_prompt": False}):
        ra = json.loads(urllib_post(type("S", (), {"http": router.openai}), "/tokenize", body))
        rb = json.loads(urllib_post(tiny, "/tokenize", body))
        assert ra == rb
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=tiny.model, messages=msgs, max_tokens=2,
                                  extra_body={"frobnicate": True})
    assert e.value.body["param"] == "frobnicate"
    # the stop reason crosses the decode worker and the router
    kw = dict(model=tiny.model, prompt="once upon a time " * 4, temperature=0, max_tokens=12,
              logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ref = tiny.client.completions.create(**kw)
    sid = int(ref.choices[0].logprobs.tokens[3].split(":")[1])
    kw["extra_body"]["stop_token_ids"] = [sid]
    a, b = c.completions.create(**kw), tiny.client.completions.create(**kw)
    assert a.choices[0].model_extra["stop_reason"] == b.choices[0].model_extra["stop_reason"] == sid
    assert a.choices[0].text == b.choices[0].text


def assert_same_alternatives(xs, ys, tol):
    """Two top-k lists of one position, from fp32 runs chunked differently: the logprobs
    equal to tol rank by rank, and a token only where the other list has it too (to tol),
    or at a near-tie with its neighbour (two alternatives within tol may swap ranks, and
    the last may swap with the k+1-th, which the other list does not show)."""
    assert [t.logprob for t in xs] == pytest.approx([t.logprob for t in ys], abs=tol)
    other = {t.token: t.logprob for t in ys}
    for i, t in enumerate(xs):
        if t.token in other:
            assert t.logprob == pytest.approx(other[t.token], abs=tol), (xs, ys)
        else:
            assert i == len(xs) - 1 or abs(t.logprob - xs[i + 1].logprob) <= tol, (xs, ys)


def test_router_logprobs_equal_serve(cluster, tiny):
    """Through a remote prefill the first token's logprobs and alternatives come with the
    KV pages (the trailer): every token's equal serve's, as do min_tokens answers."""
    router, _, _ = cluster
    c = openai.OpenAI(base_url=f"http://{router.openai}/v1", api_key="none", max_retries=0)
    kw = dict(model=tiny.model, messages=[{"role": "user", "content": "tell me more " * 6}],
              temperature=0, max_tokens=12, logprobs=True, top_logprobs=4,
              extra_body={"min_tokens": 12})
    a = c.chat.completions.create(**kw)
    b = tiny.client.chat.completions.create(**kw)
    assert metric(router.metrics(), "chunkserve:prefills_total", 'path="remote"') >= 1
    la, lb = a.choices[0].logprobs.content, b.choices[0].logprobs.content
    assert len(la) == len(lb) == 12 and a.usage.completion_tokens == 12
    for x, y in zip(la, lb):  # values to the CPU's chunking tolerance
        assert x.token == y.token and x.logprob == pytest.approx(y.logprob, abs=1e-3)
        assert len(x.top_logprobs) == 4
        assert_same_alternatives(x.top_logprobs, y.top_logprobs, 1e-3)
    assert la[0].logprob < 0  # the first token's came from the prefill worker, not a 0


def test_n_choices_share_the_prompt_pages(cluster, tiny):
    """n = 4: the first choice computes the prompt; the other three start once its pages
    are in the prefix cache and reuse them (the prefill worker's hit counter), through the
    router as through serve."""
    router, decode, prefill = cluster
    c = openai.OpenAI(base_url=f"http://{router.openai}/v1", api_key="none", max_retries=0)
    prompt = "shared pages " + " ".join(f"w{i}" for i in range(120))
    before = prefill.metric("chunkserve:prefix_cache_hit_tokens_total")
    r = c.completions.create(model=tiny.model, prompt=prompt, max_tokens=4, n=4, seed=9,
                             temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]
    assert all(ch.finish_reason == "length" for ch in r.choices)
    assert r.usage.completion_tokens == 16
    hits = prefill.metric("chunkserve:prefix_cache_hit_tokens_total") - before
    page = 16
    assert hits >= 3 * (r.usage.prompt_tokens // page - 1) * page, (hits, r.usage)


def test_decode_killed_mid_stream_completes_without_duplicates(cluster, tiny, pb):
    router, decode, _ = cluster
    c = openai.OpenAI(base_url=f"http://{router.openai}/v1", api_key="none", max_retries=0)
    kw = dict(model=tiny.model, prompt="abc", temperature=0, max_tokens=1500,
              extra_body={"ignore_eos": True})
    want = tiny.client.completions.create(**kw).choices[0].text
    it = iter(c.completions.create(**kw, stream=True))
    got = [next(it).choices[0].text]
    busy = [d for d in decode if worker_status(pb, d).num_running]
    assert len(busy) == 1
    busy[0].kill9()
    got += [ch.choices[0].text for ch in it]
    assert "".join(got) == want
    assert metric(router.metrics(), "chunkserve:migrations_total") >= 1


def test_serve_exports_the_engine_metrics(tiny, bin_dir):
    """serve's ops port exports the engine's and the token metrics under the names the
    workers export (one table, api/engine_metrics.c: what the chart's autoscalers and
    dashboards read), with values that move with the requests."""
    import urllib.request
    from cluster_harness import exported_series, metric as metric_of
    for _ in range(3):
        tiny.client.completions.create(model=tiny.model, prompt="hello there", max_tokens=5,
                                       extra_body={"ignore_eos": True})
    with urllib.request.urlopen(f"http://{tiny.ops}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            m[k] = float(v)
    table = json.loads(subprocess.run([str(bin_dir / "chunkserve-decode"), "--metrics-json"],
                                      check=True, capture_output=True, text=True).stdout)
    declared = {t["name"] + ("{" + t["labels"] + "}" if t["labels"] else "") for t in table}
    live = exported_series(m) - {"chunkserve:draining"}
    assert live <= declared, live - declared
    for name in ("chunkserve:num_requests_running", "chunkserve:num_requests_waiting",
                 "chunkserve:kv_cache_usage_perc", "chunkserve:queued_prefill_tokens",
                 "chunkserve:requests_refused_total",
                 "chunkserve:time_to_first_token_seconds", "chunkserve:inter_token_latency_seconds"):
        assert name in live, name
    assert metric_of(m, "chunkserve:generation_tokens_total") >= 15
    assert metric_of(m, "chunkserve:prompt_tokens_total") > 0
    assert metric_of(m, "chunkserve:time_to_first_token_seconds_count") >= 3
    assert metric_of(m, "chunkserve:inter_token_latency_seconds_count") >= 12
    assert metric_of(m, "chunkserve:kv_pages_total") > 0


def test_speculation_through_the_openai_door(chunkserve_bin, model_path, pb, real):
    """`--speculative ngram` behind the OpenAI door: completions and chat answers equal serve
    without it (greedy and seeded, logprobs included), and `disable_speculation` in the
    request body drafts nothing (the spec_decode counters do not move)."""
    from cluster_harness import spec_counters

    spec = Serve(chunkserve_bin, model_path, pb, "--speculative", "ngram")

    def counters():
        return spec_counters(spec.ops)

    prompt = ("Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, "
              "cherries.\nList: apples, pears,")
    try:
        for extra in ({"temperature": 0}, {"seed": 7, "temperature": 0.8}):
            kw = dict(prompt=prompt, max_tokens=32, logprobs=2, **extra)
            before = counters()
            want = real.client.completions.create(model=real.model, **kw).choices[0]
            got = spec.client.completions.create(model=spec.model, **kw).choices[0]
            assert got.text == want.text
            assert got.logprobs.token_logprobs == want.logprobs.token_logprobs
            assert got.logprobs.top_logprobs == want.logprobs.top_logprobs
            if extra["temperature"] == 0:  # this very request drafted, and kept some
                after = counters()
                k = "chunkserve:spec_decode_num_accepted_tokens_total"
                assert after[k] > before.get(k, 0), (before, after)
        msgs = [{"role": "user", "content": prompt}]
        want = real.client.chat.completions.create(model=real.model, messages=msgs, max_tokens=32,
                                                   temperature=0)
        got = spec.client.chat.completions.create(model=spec.model, messages=msgs, max_tokens=32,
                                                  temperature=0)
        assert got.choices[0].message.content == want.choices[0].message.content
        before = counters()
        assert before["chunkserve:spec_decode_num_drafts_total"] > 0, before
        out = spec.client.completions.create(model=spec.model, prompt=prompt, max_tokens=32,
                                             temperature=0,
                                             extra_body={"disable_speculation": True})
        assert out.choices[0].text == real.client.completions.create(
            model=real.model, prompt=prompt, max_tokens=32, temperature=0).choices[0].text
        assert counters() == before
        with pytest.raises(openai.BadRequestError) as bad:
            spec.client.completions.create(model=spec.model, prompt=prompt, max_tokens=4,
                                           extra_body={"disable_speculation": "yes"})
        assert "disable_speculation" in str(bad.value)
    finally:
        spec.stop()


def test_priority_is_served_and_bounded(tiny):
    """vLLM's `priority` (lower first): accepted on both doors with the same answer as
    without it (it changes only the order), refused by name outside [0, 1000000]."""
    base = tiny.client.completions.create(model=tiny.model, prompt="hello there", max_tokens=6,
                                          temperature=0)
    for p in (0, 7, 1000000):
        r = tiny.client.completions.create(model=tiny.model, prompt="hello there", max_tokens=6,
                                           temperature=0, extra_body={"priority": p})
        assert r.choices[0].text == base.choices[0].text
    r = tiny.client.chat.completions.create(model=tiny.model, max_tokens=2,
                                            messages=[{"role": "user", "content": "hi"}],
                                            extra_body={"priority": 3})
    assert r.choices[0].finish_reason
    for bad in (-1, 1000001, 1.5, "high"):
        with pytest.raises(openai.BadRequestError) as e:
            tiny.client.completions.create(model=tiny.model, prompt="hi", max_tokens=2,
                                           extra_body={"priority": bad})
        assert e.value.body["param"] == "priority", e.value.body
