"""The disaggregated cluster end to end (CTest label `cluster`): real
chunkserve-prefill / chunkserve-decode / chunkserve-router processes on
loopback with the real model, real grpcio clients, workers killed with -9 and
restarted. Greedy output must equal `chunkserve generate` exactly: across
local and remote prefill, KV transfers, retries and migrations."""
from __future__ import annotations

import collections
import concurrent.futures as cf
import signal
import subprocess
import threading
import time

import grpc
import pytest

from cluster_harness import Cluster, Proc, generate, metric, wait_for

pytestmark = pytest.mark.cluster

THRESHOLD = 256  # prompts below it are prefilled on the decode worker


@pytest.fixture(scope="module")
def pb(proto_modules):
    return type("PB", (), proto_modules)


@pytest.fixture(scope="module")
def bins(bin_dir):
    for b in ("chunkserve-router", "chunkserve-prefill", "chunkserve-decode"):
        if not (bin_dir / b).is_file():
            pytest.skip(f"{b} not built")
    return bin_dir


@pytest.fixture(scope="module")
def corpus(repo_root):
    return (repo_root / "docs" / "architecture.md").read_text()


def long_prompt(corpus: str, i: int, chars: int) -> str:
    start = (i * 977) % (len(corpus) - chars)
    return corpus[start:start + chars] + "\n\nQuestion: what is the text above about?\nAnswer:"


SHORT = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
         "Once upon a time", "The opposite of hot is", "def fibonacci(n):", "Translate 'cat' to French:",
         "My favourite colour is"]


@pytest.fixture(scope="module")
def workload(corpus, cli):
    """32 prompts of mixed lengths with their single-process greedy answers."""
    items = []
    for i in range(32):
        if i % 2:
            prompt, n = long_prompt(corpus, i, 1500 + 300 * (i % 5)), 8 + i % 5
        else:
            prompt, n = SHORT[(i // 2) % len(SHORT)] + " " * (i // 16), 12 + i % 7
        want = cli.run("generate", "--prompt", prompt, "--max-tokens", str(n), "--threads", "2",
                       timeout=300).decode()
        assert want.endswith("\n")
        items.append((prompt, n, want[:-1]))
    return items


@pytest.fixture(scope="module")
def cluster(bins, model_path, pb):
    c = Cluster(bins, model_path, pb, n_prefill=2, n_decode=2,
                router_args=[f"--local-prefill-threshold={THRESHOLD}"])
    yield c
    c.stop()


def run_all(c, g, items, workers=32):
    def one(item):
        prompt, n, _ = item
        return generate(c.stub, g, prompt=prompt, max_tokens=n)
    with cf.ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, items))


def test_32_mixed_requests_exact(cluster, workload, pb, cli):
    g = pb.generation_pb2
    before = [p.metrics() for p in cluster.prefill + cluster.decode]
    results = run_all(cluster, g, workload)
    for (prompt, n, want), (ids, text, finish, msgs) in zip(workload, results):
        assert text == want, f"prompt {prompt[:40]!r}...: cluster {text!r} != generate {want!r}"
        assert finish in (g.FINISH_REASON_LENGTH, g.FINISH_REASON_STOP)
        assert msgs[-1].usage.completion_tokens == len(ids)
    rm = cluster.router.metrics()
    assert metric(rm, "chunkserve:prefills_total", 'path="local"') >= 8
    assert metric(rm, "chunkserve:prefills_total", 'path="remote"') >= 8
    def sent_since():  # the senders count a transfer when its acknowledgement comes back
        return sum(p.metric("chunkserve:kv_transfers_completed_total") -
                   metric(b, "chunkserve:kv_transfers_completed_total")
                   for p, b in zip(cluster.prefill, before[:2]))
    wait_for(lambda: sent_since() >= 8, 30, "the prefill workers to count 8 transfers completed")
    sent = sent_since()
    after = [p.metrics() for p in cluster.prefill + cluster.decode]
    received = sum(metric(a, "chunkserve:kv_transfers_completed_total") -
                   metric(b, "chunkserve:kv_transfers_completed_total")
                   for a, b in zip(after[2:], before[2:]))
    assert sent >= 8 and received >= 8, (sent, received)
    assert sum(metric(a, "chunkserve:kv_transfer_bytes_total") for a in after[2:]) > 0
    # the decode workers measured the router-to-worker hop of every request
    assert sum(metric(a, "chunkserve:router_to_worker_seconds_count") -
               metric(b, "chunkserve:router_to_worker_seconds_count")
               for a, b in zip(after[2:], before[2:])) >= 32
    cluster.wait_idle()


def test_bad_input_never_reaches_workers(cluster, pb):
    g = pb.generation_pb2
    before = [metric(p.metrics(), "chunkserve:prefills_total", 'path="local"') +
              metric(p.metrics(), "chunkserve:prefills_total", 'path="remote"') for p in cluster.decode]
    bad = [g.GenerateRequest(prompt=""),
           g.GenerateRequest(prompt="hi", sampling=g.SamplingParams(temperature=-1)),
           g.GenerateRequest(prompt="hi", model="no-such-model"),
           g.GenerateRequest(token_ids=g.TokenIds(ids=[1, 10 ** 9]))]
    for req in bad:
        with pytest.raises(grpc.RpcError) as e:
            list(cluster.stub.Generate(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    after = [metric(p.metrics(), "chunkserve:prefills_total", 'path="local"') +
             metric(p.metrics(), "chunkserve:prefills_total", 'path="remote"') for p in cluster.decode]
    assert before == after


def test_cancel_mid_stream_frees_pages(cluster, corpus, pb):
    g = pb.generation_pb2
    # a decode in progress (local prefill), and a long prompt still prefilling remotely
    for prompt, wait_first in (("Tell me a long story about a dragon.", True),
                               (long_prompt(corpus, 3, 6000), False)):
        call = cluster.stub.Generate(g.GenerateRequest(
            prompt=prompt, sampling=g.SamplingParams(max_tokens=400, ignore_eos=True)), timeout=120)
        if wait_first:
            next(call)
            next(call)
        else:
            time.sleep(1.0)
        call.cancel()
        cluster.wait_idle()


def test_kill_prefill_worker_mid_prefill(cluster, workload, corpus, pb, cli):
    g = pb.generation_pb2
    items = [(long_prompt(corpus, 40 + i, 5000), 6, None) for i in range(4)]
    wants = [cli.run("generate", "--prompt", p, "--max-tokens", str(n), "--threads", "2",
                     timeout=300).decode()[:-1] for p, n, _ in items]
    retries0 = metric(cluster.router.metrics(), "chunkserve:retries_total")
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(generate, cluster.stub, g, p, None, n) for p, n, _ in items]
        victim = None
        t_end = time.monotonic() + 60
        while victim is None and time.monotonic() < t_end:
            for p in cluster.prefill:
                if cluster.status(p).queued_prefill_tokens > 0:
                    victim = p
                    break
            time.sleep(0.05)
        assert victim is not None, "no prefill worker ever had queued tokens"
        victim.kill9()
        results = [f.result(timeout=300) for f in futs]
    for want, (ids, text, finish, _) in zip(wants, results):
        assert text == want
    assert metric(cluster.router.metrics(), "chunkserve:retries_total") > retries0
    victim.start(port=victim.port)  # rejoins
    cluster.wait_usable(2, 2)
    cluster.wait_idle()


def test_kill_decode_worker_mid_stream_migrates(cluster, workload, pb, cli):
    g = pb.generation_pb2
    prompts = [f"Write a long essay about topic number {i}:" for i in range(4)]
    n = 48
    wants = [cli.run("generate", "--prompt", p, "--max-tokens", str(n), "--ignore-eos", "--threads", "2",
                     timeout=300).decode()[:-1] for p in prompts]
    mig0 = metric(cluster.router.metrics(), "chunkserve:migrations_total")
    got = [[] for _ in prompts]
    started = threading.Barrier(len(prompts) + 1, timeout=120)

    def stream(i):
        ids, texts = [], []
        first = True
        for m in cluster.stub.Generate(g.GenerateRequest(
                prompt=prompts[i], sampling=g.SamplingParams(max_tokens=n, ignore_eos=True)), timeout=300):
            ids += m.token_ids
            texts.append(m.text)
            if first and len(ids) >= 4:
                first = False
                started.wait()
        got[i] = (ids, "".join(texts))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait()
    victim = max(cluster.decode, key=lambda p: cluster.status(p).num_running)
    victim.kill9()
    for t in threads:
        t.join(300)
    for want, (ids, text) in zip(wants, got):
        assert len(ids) == n, "duplicated or missing tokens at the client"
        assert text == want
    assert metric(cluster.router.metrics(), "chunkserve:migrations_total") > mig0
    # restart it: it rejoins and serves
    victim.start(port=victim.port)  # a new process: its counters start at 0
    cluster.wait_usable(2, 2)
    for _ in range(8):
        generate(cluster.stub, g, prompt="Hello there", max_tokens=4)
    assert metric(victim.metrics(), "chunkserve:generation_tokens_total") > 0
    cluster.wait_idle()


def test_no_worker_unavailable(bins, model_path, pb):
    g = pb.generation_pb2
    # nothing listens on the decode address: UNAVAILABLE promptly, not at the deadline
    dead = Proc(bins / "chunkserve-router", [f"--model={model_path}", "--port=0",
                                             "--decode-workers=127.0.0.1:1", "--no-worker-wait-ms=1000"],
                "router-dead")
    ch = grpc.insecure_channel(dead.addr)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(pb.generation_pb2_grpc.GenerationStub(ch).Generate(g.GenerateRequest(prompt="hi"), timeout=60))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert time.monotonic() - t0 < 30
    ch.close()
    assert dead.stop() == 0


def test_overload_resource_exhausted(bins, model_path, pb, corpus):
    g = pb.generation_pb2
    c = Cluster(bins, model_path, pb, n_prefill=0, n_decode=1,
                router_args=["--max-inflight=1", "--max-queue=1"])
    try:
        def one(i):
            try:
                generate(c.stub, g, prompt=long_prompt(corpus, i, 800), max_tokens=32, ignore_eos=True)
                return "ok"
            except grpc.RpcError as e:
                return e.code()
        with cf.ThreadPoolExecutor(6) as ex:
            codes = list(ex.map(one, range(6)))
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes
        assert "ok" in codes
        c.wait_idle()
    finally:
        c.stop()


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                  "wait_for_ready", "compression")),
               grpc.ClientCallDetails):
    pass


class _Auth(grpc.UnaryStreamClientInterceptor):
    """Adds the API key to every streaming call's metadata."""

    def __init__(self, key):
        self.key = key

    def intercept_unary_stream(self, continuation, d, request):
        md = list(d.metadata or []) + [("authorization", f"Bearer {self.key}")]
        return continuation(_Details(d.method, d.timeout, md, d.credentials, d.wait_for_ready,
                                     d.compression), request)


def test_cluster_up_and_clean_shutdown_with_streams(bins, model_path, pb, bin_dir):
    """`chunkserve cluster up` in the foreground; SIGINT with streams in flight stops everything."""
    g = pb.generation_pb2
    key = "cluster-up-key-0123456789"
    proc = subprocess.Popen([str(bin_dir / "chunkserve"), "cluster", "up", "--model", str(model_path),
                             "--prefill", "1", "--decode", "1", "--port", "0", "--grace-ms", "1000",
                             "--openai-port", "0", "--api-key", key,
                             "--cors-allow-origins", "https://a.example"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        addr = http = None
        t_end = time.monotonic() + 120
        while (addr is None or http is None) and time.monotonic() < t_end:
            line = proc.stdout.readline()
            assert line, "cluster up exited while starting"
            if line.startswith("listening on "):
                addr = line.split()[-1]
            if line.startswith("openai listening on "):
                http = line.split()[-1]
        # --api-key and --cors-allow-origins reach the router (the key through its environment)
        import urllib.request
        req = urllib.request.Request(f"http://{http}/v1/models", headers={"Origin": "https://a.example"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 401
        req.add_header("Authorization", f"Bearer {key}")
        with urllib.request.urlopen(req, timeout=10) as f:
            assert f.status == 200 and f.headers["Access-Control-Allow-Origin"] == "https://a.example"
        ch = grpc.insecure_channel(addr)
        stub = pb.generation_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            generate(stub, g, prompt="hi", max_tokens=1)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ch.close()
        ch = grpc.intercept_channel(grpc.insecure_channel(addr), _Auth(key))
        stub = pb.generation_pb2_grpc.GenerationStub(ch)
        ids, text, finish, _ = generate(stub, g, prompt="The capital of France is", max_tokens=8)
        assert len(ids) >= 1 and text
        results = []

        def long_stream():
            try:
                generate(stub, g, prompt="Count to one thousand:", max_tokens=2000, ignore_eos=True)
                results.append("ok")
            except grpc.RpcError as e:
                results.append(e.code())
        threads = [threading.Thread(target=long_stream) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        for t in threads:
            t.join(30)
        assert len(results) == 3 and all(r != "ok" for r in results), results
        ch.close()
    finally:
        if proc.poll() is None:
            proc.kill()
