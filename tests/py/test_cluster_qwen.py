"""The disaggregated cluster on a real K-quant model (CTest label `cluster`, through the
`cluster` CTest's `pytest -m cluster tests/py`): Qwen2.5-Coder-0.5B-Instruct Q4_K_M
(qwen2, 24 layers, Q4_K/Q5_0/Q6_K/Q8_0 parts) in a real chunkserve-router + 1
chunkserve-prefill + 2 chunkserve-decode processes on loopback, driven by a grpcio client.

Every stream must equal one process exactly (token ids, text, finish reason, usage):
`chunkserve serve` on the same model with the same gRPC request (harness.Reference's
server), and for greedy text also `chunkserve generate` (test_cluster.py's reference):
 - greedy, raw and chat-templated prompts, short ones prefilled on the decode worker and
   long ones on the prefill worker (KV pages over the KV transport), all in flight at once;
 - seeded sampling (temperature, top_p, top_k, a penalty), short and long, raw and chat;
 - the decode worker running the most of 5 streams (greedy and seeded) SIGKILLed mid-stream:
   its streams migrate (a long context through the prefill worker again, short ones
   prefilled on the survivor) and complete with the one-process tokens, none duplicated
   or missing; the killed worker restarts and rejoins;
and afterwards every live worker is idle with every KV page free.

About 2 minutes on 2 cores (each worker runs 1 thread; the references 2)."""
from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest

grpc = pytest.importorskip("grpc")

from cluster_harness import Cluster, Reference, metric, wait_for  # noqa: E402

pytestmark = pytest.mark.cluster

THRESHOLD = 128  # tokens: shorter contexts prefill on the decode worker, longer remotely

# A fixed code excerpt for a long chat prompt (~400 tokens with the template).
CODE = '''\
import heapq
from collections import defaultdict


def dijkstra(graph, source):
    """Shortest distances from source in a graph of non-negative edge weights.

    graph: {node: [(neighbour, weight), ...]}
    """
    dist = defaultdict(lambda: float("inf"))
    dist[source] = 0
    prev = {}
    heap = [(0, source)]
    done = set()
    while heap:
        d, u = heapq.heappop(heap)
        if u in done:
            continue
        done.add(u)
        for v, w in graph.get(u, ()):
            if w < 0:
                raise ValueError(f"negative edge {u}->{v}: {w}")
            nd = d + w
            if nd < dist[v]:
                dist[v] = nd
                prev[v] = u
                heapq.heappush(heap, (nd, v))
    return dict(dist), prev


def path_to(prev, source, target):
    path = [target]
    while path[-1] != source:
        if path[-1] not in prev:
            return None
        path.append(prev[path[-1]])
    return path[::-1]


if __name__ == "__main__":
    g = {"a": [("b", 7), ("c", 9), ("f", 14)], "b": [("c", 10), ("d", 15)],
         "c": [("d", 11), ("f", 2)], "d": [("e", 6)], "f": [("e", 9)]}
    dist, prev = dijkstra(g, "a")
    print(dist["e"], path_to(prev, "a", "e"))
'''


@pytest.fixture(scope="module")
def pb(proto_modules):
    return type("PB", (), proto_modules)


@pytest.fixture(scope="module")
def qwen(named_model):
    return named_model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def bins(bin_dir):
    for b in ("chunkserve-router", "chunkserve-prefill", "chunkserve-decode", "chunkserve"):
        if not (bin_dir / b).is_file():
            pytest.skip(f"{b} not built")
    return bin_dir


@pytest.fixture(scope="module")
def corpus(repo_root):
    return (repo_root / "docs" / "architecture.md").read_text()


@pytest.fixture(scope="module")
def ref(bins, qwen, pb):
    # the last --threads / --kv-cache-mib win over Reference's own (room for long prompts;
    # the engine's bits do not depend on the thread count)
    r = Reference(bins / "chunkserve", qwen, pb, "--threads", "2", "--kv-cache-mib", "128")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def cluster(bins, qwen, pb, ref):
    c = Cluster(bins, qwen, pb, n_prefill=1, n_decode=2, threads=1, kv_cache_mib=128,
                router_args=[f"--local-prefill-threshold={THRESHOLD}"])
    yield c
    c.stop()


def raw(prompt):
    return dict(prompt=prompt)


def chat(user, system=None):
    return dict(chat=[("system", system)] * (system is not None) + [("user", user)])


def request(g, inp, n, **sampling):
    if "chat" in inp:
        inp = dict(chat=g.Chat(messages=[g.ChatMessage(role=r, content=c) for r, c in inp["chat"]]))
    return g.GenerateRequest(**inp, sampling=g.SamplingParams(max_tokens=n, **sampling))


def summary(msgs):
    """(ids, text, finish, (prompt_tokens, completion_tokens)) of one finished stream."""
    last = msgs[-1]
    return ([t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs),
            last.finish_reason, (last.usage.prompt_tokens, last.usage.completion_tokens))


def run(stub, g, inp, n, **sampling):
    return summary(list(stub.Generate(request(g, inp, n, **sampling), timeout=300)))


def cli_text(cli_exe, model, inp, n, **sampling):
    """`chunkserve generate`'s text for the same request (stdout less its final newline)."""
    from conftest import run_cli
    args = ["generate", "--model", model, "--max-tokens", n, "--threads", "2"]
    if "chat" in inp:
        msgs = dict(inp["chat"])
        args += ["--chat", "--prompt", msgs["user"]]
        if "system" in msgs:
            args += ["--system", msgs["system"]]
    else:
        args += ["--prompt", inp["prompt"]]
    flags = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
             "seed": "--seed", "repetition_penalty": "--repetition-penalty",
             "presence_penalty": "--presence-penalty", "ignore_eos": "--ignore-eos"}
    for k, v in sampling.items():
        args += [flags[k]] if v is True else [flags[k], v]
    out = run_cli(cli_exe, args, timeout=300).decode()
    assert out.endswith("\n"), out
    return out[:-1]


def stream_threads(cluster, g, items, ns, sampling, timeout=300):
    """One (unstarted) thread per request streaming it from the cluster. Returns (got,
    progress, errors, threads): got[i] the finished stream's summary, progress[i] the tokens
    received so far, errors the (i, exception) of streams that failed."""
    got, progress, errors = [None] * len(items), [0] * len(items), []

    def stream(i):
        msgs = []
        try:
            for m in cluster.stub.Generate(request(g, items[i], ns[i], **sampling[i]),
                                           timeout=timeout):
                msgs.append(m)
                progress[i] += len(m.token_ids)
            got[i] = summary(msgs)
        except Exception as e:  # noqa: BLE001 (the caller reports it)
            errors.append((i, repr(e)))

    return got, progress, errors, [threading.Thread(target=stream, args=(i,))
                                   for i in range(len(items))]


def check_migrated(wants, got, errors, ns, when):
    """Every stream finished with exactly the one-process summary (none duplicated or
    missing) though its worker was killed; `when` says how, for the failure message."""
    assert not errors, errors
    for i, (want, g_, n) in enumerate(zip(wants, got, ns)):
        assert g_ is not None, f"stream {i} did not finish"
        assert len(g_[0]) == n, f"stream {i}: {len(g_[0])} tokens, want {n} (duplicated or missing)"
        if g_[0] != want[0]:
            k = next(j for j, (a, b) in enumerate(zip(g_[0], want[0])) if a != b)
            pytest.fail(f"stream {i} diverged from one process at output token {k} ({when}): "
                        f"cluster {g_[0][k:k + 8]} vs serve {want[0][k:k + 8]}")
        assert g_ == want, f"stream {i}: {g_} != {want}"


def excerpt(corpus, i, chars):
    start = (i * 4099) % (len(corpus) - chars)
    return corpus[start:start + chars]


def check_all(cluster, ref, pb, bins, qwen, items, label, cli=False):
    """items: [(name, input, n, sampling)], all in flight at once on the cluster; each equal
    to `chunkserve serve` (ids, text, finish, usage) and with cli to `chunkserve generate`
    (text)."""
    g = pb.generation_pb2
    wants = [run(ref.stub, g, inp, n, **s) for _, inp, n, s in items]
    with cf.ThreadPoolExecutor(len(items)) as ex:
        gots = list(ex.map(lambda it: run(cluster.stub, g, it[1], it[2], **it[3]), items))
    for (name, inp, n, s), want, got in zip(items, wants, gots):
        ids_w, ids_g = want[0], got[0]
        if ids_g != ids_w:
            k = next((i for i, (a, b) in enumerate(zip(ids_g, ids_w)) if a != b),
                     min(len(ids_g), len(ids_w)))
            pytest.fail(f"{label} {name}: cluster tokens differ from one process at output "
                        f"token {k} (prompt {want[3][0]} tokens): cluster {ids_g[k:k + 8]} vs "
                        f"serve {ids_w[k:k + 8]}; cluster text {got[1]!r}, serve text {want[1]!r}")
        assert got == want, f"{label} {name}: cluster {got} != serve {want}"
        assert len(ids_w) >= 1 and want[3][1] == len(ids_w)
        if not cli:
            continue
        text = cli_text(bins / "chunkserve", qwen, inp, n, **s)
        assert got[1] == text, f"{label} {name}: cluster {got[1]!r} != generate {text!r}"
    return wants


def prefills(c):
    m = c.router.metrics()
    return (metric(m, "chunkserve:prefills_total", 'path="local"'),
            metric(m, "chunkserve:prefills_total", 'path="remote"'))


def test_greedy_equals_one_process(cluster, ref, pb, bins, qwen, corpus):
    items = [
        ("raw short code", raw("def quicksort(arr):"), 24, {}),
        ("raw short prose", raw("The three primary colours are"), 16, {}),
        ("chat short", chat("Write a haiku about the sea."), 24, {}),
        ("raw long", raw(excerpt(corpus, 1, 1600) + "\n\nIn one sentence, the text above is about"),
         16, {}),
        ("chat long with system", chat(CODE + "\nWhat does this program print? Explain briefly.",
                                       system="You are a careful code reviewer."), 24, {}),
        ("chat long", chat(excerpt(corpus, 2, 2400) + "\n\nSummarize the text above."), 12, {}),
    ]
    local0, remote0 = prefills(cluster)
    check_all(cluster, ref, pb, bins, qwen, items, "greedy", cli=True)
    local1, remote1 = prefills(cluster)
    # the three short prompts prefilled on a decode worker, the three long ones remotely
    assert local1 - local0 >= 3 and remote1 - remote0 >= 3, (local0, local1, remote0, remote1)
    cluster.wait_idle()


def test_seeded_sampling_equals_one_process(cluster, ref, pb, bins, qwen, corpus):
    s = dict(temperature=0.8, top_p=0.95)
    items = [
        ("raw short", raw("def is_prime(n):"), 24, dict(s, seed=7)),
        ("chat short", chat("Name three sorting algorithms."), 24,
         dict(s, seed=1234, top_k=40, ignore_eos=True)),
        ("raw long", raw(excerpt(corpus, 5, 1800) + "\n\nQuestion: what is described above?\nAnswer:"),
         20, dict(s, seed=99, repetition_penalty=1.1)),
        ("chat long", chat(CODE + "\nSuggest one improvement."), 20,
         dict(temperature=1.0, seed=2024, presence_penalty=0.5, ignore_eos=True)),
    ]
    local0, remote0 = prefills(cluster)
    check_all(cluster, ref, pb, bins, qwen, items, "seeded")
    local1, remote1 = prefills(cluster)
    assert local1 - local0 >= 2 and remote1 - remote0 >= 2, (local0, local1, remote0, remote1)
    cluster.wait_idle()


def test_kill_decode_worker_mid_stream_migrates(cluster, ref, pb, corpus):
    """Two long prompts (prefilled remotely) start one after the other, so the second goes
    to the other decode worker (placement by free KV pages; raw prompts that share no page
    with earlier ones, so prefix routing has no say), then three short ones (prefilled on
    the decode workers); once each has 4 tokens, the decode worker running the most
    streams is SIGKILLed. Its streams migrate (the long context through the prefill worker
    again, the short ones prefilled on the survivor) and every stream finishes with exactly
    the one-process tokens (none twice, none missing)."""
    g = pb.generation_pb2
    ns = [96, 80, 40, 40, 40]  # the first long stream decodes while the second prefills
    items = [raw(excerpt(corpus, 7, 900) + "\n\nA detailed explanation of the above:"),
             raw(excerpt(corpus, 8, 900) + "\n\nExplain the text above to a new engineer:"),
             raw("Write a long essay about the history of the Python language:"),
             chat("Explain, step by step, how a hash table works."),
             raw("Once upon a time, in a land far away,")]
    sampling = [dict(ignore_eos=True, temperature=0.7, top_p=0.9, seed=5), dict(ignore_eos=True),
                dict(ignore_eos=True), dict(ignore_eos=True),
                dict(ignore_eos=True, temperature=0.9, top_k=50, seed=11)]
    wants = [run(ref.stub, g, inp, n, **s) for inp, n, s in zip(items, ns, sampling)]
    assert [len(w[0]) for w in wants] == ns
    mig0 = metric(cluster.router.metrics(), "chunkserve:migrations_total")
    local0, remote0 = prefills(cluster)
    kv0 = [p.metric("chunkserve:kv_transfers_completed_total") for p in cluster.decode]
    got, progress, errors, threads = stream_threads(cluster, g, items, ns, sampling)
    for i in (0, 1):  # the first one's pages are taken (its KV arrived) before the second
        threads[i].start()
        wait_for(lambda: progress[i] >= 1 or errors, 120, f"long prompt {i}'s first token")
    for t in threads[2:]:
        t.start()
    wait_for(lambda: min(progress) >= 4 or errors, 120, "every stream's first tokens")
    assert not errors, errors
    kv = [p.metric("chunkserve:kv_transfers_completed_total") - k
          for p, k in zip(cluster.decode, kv0)]
    running = {p.name: cluster.status(p).num_running for p in cluster.decode}
    victim = max(cluster.decode, key=lambda p: running[p.name])
    at_kill = list(progress)
    victim.kill9()
    assert all(a < n for a, n in zip(at_kill, ns)), f"a stream had finished before the kill: {at_kill}"
    # one long prompt's KV pages went to each decode worker, so the victim (>= 3 of the 5
    # streams) ran a long stream and at least two short ones
    assert kv == [1, 1], kv
    assert running[victim.name] >= 3, running
    for t in threads:
        t.join(300)
    check_migrated(wants, got, errors, ns, f"killed at {at_kill}, running {running}")
    migrations = metric(cluster.router.metrics(), "chunkserve:migrations_total") - mig0
    assert migrations >= running[victim.name], (migrations, running)
    # the long prompts' first prefills and the migrated long context's went to the prefill
    # worker; the short prompts' and the migrated short contexts' ran on a decode worker
    local1, remote1 = prefills(cluster)
    assert remote1 - remote0 >= 3 and local1 - local0 >= 3 + running[victim.name] - 1, (
        local0, local1, remote0, remote1, running)
    # the killed worker restarts on its port and rejoins; then everything is idle and free
    victim.start(port=victim.port)
    cluster.wait_usable(1, 2)
    assert run(cluster.stub, g, items[2], 8, ignore_eos=True)[0] == wants[2][0][:8]
    cluster.wait_idle()
