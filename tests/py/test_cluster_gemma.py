"""The disaggregated cluster on Gemma-3-270M Q4_K_M (gemma3: 512-position windows on 15 of its
18 layers) with an 8,000-token prompt, longer than 15 windows (CTest label `cluster`, through
the `cluster` CTest's `pytest -m cluster tests/py`).

A real chunkserve-router + 1 chunkserve-prefill + 2 chunkserve-decode processes on loopback,
driven by a grpcio client; every stream must equal `chunkserve serve` on the same model with
the same request (token ids, text, finish reason, usage):
 - the 8k prompt (prefilled on the prefill worker, its KV pages sent to a decode worker) and
   a short one (prefilled on a decode worker) in flight together, greedy and seeded;
 - the decode worker running the 8k stream SIGKILLed mid-stream: the stream migrates (its
   context prefilled by the prefill worker again) and completes with the one-process
   tokens, none duplicated or missing;
and afterwards every live worker is idle with every KV page free.

The prefill worker sends, for the windowed layers, only the pages of the last window (the
decode worker's next query sees nothing before it), and for the global layers every page: the
bytes that arrive are counted and must be exactly that.
"""
from __future__ import annotations

import pytest

grpc = pytest.importorskip("grpc")

from cluster_harness import Cluster, Reference, metric, wait_for  # noqa: E402
# the proto and binaries fixtures and the request helpers of the Qwen cluster test
from test_cluster_qwen import bins, check_migrated, pb, raw, run, stream_threads  # noqa: E402,F401

pytestmark = pytest.mark.cluster

THRESHOLD = 128  # tokens: shorter contexts prefill on the decode worker, longer remotely
KV_MIB = 640     # 8k positions of fp32 pages: 18 layers x 2 x 256 x 4 bytes = 36 KiB a position
# The model's KV blocks (chunkserve/kv_cache.h): pages of 3 layers (gcd of 3 global, 15 windowed),
# 6 a block of 16 positions, one of them global; windows of 512 positions.
PAGE_SIZE, PER_BLOCK, N_GLOBAL, WINDOW = 16, 6, 1, 512
PAGE_BYTES = 3 * 2 * PAGE_SIZE * 256 * 4


def window_aware_bytes(n: int) -> tuple[int, int]:
    """(bytes a transfer of n positions moves, bytes of every page of every block)."""
    blocks = -(-n // PAGE_SIZE)
    wb = max(0, n - WINDOW + 1) // PAGE_SIZE
    return ((N_GLOBAL * blocks + (PER_BLOCK - N_GLOBAL) * (blocks - wb)) * PAGE_BYTES,
            PER_BLOCK * blocks * PAGE_BYTES)


@pytest.fixture(scope="module")
def gemma(named_model):
    return named_model("gemma3-270m")


@pytest.fixture(scope="module")
def long_prompt(repo_root):
    """About 8,000 tokens of this repository's documentation."""
    text = "".join((repo_root / "docs" / f).read_text()
                   for f in ("architecture.md", "perf.md", "deploy.md"))
    return text[:30000] + "\n\nA summary of the documents above:"


@pytest.fixture(scope="module")
def ref(bins, gemma, pb):
    r = Reference(bins / "chunkserve", gemma, pb, "--threads", "2", "--kv-cache-mib", str(KV_MIB))
    yield r
    r.stop()


@pytest.fixture(scope="module")
def cluster(bins, gemma, pb, ref):
    c = Cluster(bins, gemma, pb, n_prefill=1, n_decode=2, threads=1, kv_cache_mib=KV_MIB,
                router_args=[f"--local-prefill-threshold={THRESHOLD}"])
    yield c
    c.stop()


def test_long_prompt_survives_killing_its_decode_worker(cluster, ref, pb, long_prompt):
    g = pb.generation_pb2
    items = [raw(long_prompt), raw("The three most useful kitchen tools are")]
    ns = [64, 24]  # the long stream decodes long enough to be killed mid-stream
    sampling = [dict(ignore_eos=True), dict(ignore_eos=True, temperature=0.8, top_p=0.9, seed=3)]
    wants = [run(ref.stub, g, inp, n, **s) for inp, n, s in zip(items, ns, sampling)]
    assert wants[0][3][0] >= 8000, f"the long prompt is {wants[0][3][0]} tokens"
    assert [len(w[0]) for w in wants] == ns
    mig0 = metric(cluster.router.metrics(), "chunkserve:migrations_total")
    kv0 = [p.metric("chunkserve:kv_transfers_completed_total") for p in cluster.decode]
    bytes0 = [p.metric("chunkserve:kv_transfer_bytes_total") for p in cluster.decode]
    got, progress, errors, threads = stream_threads(cluster, g, items, ns, sampling, timeout=600)
    for t in threads:
        t.start()
    wait_for(lambda: min(progress) >= 4 or errors, 400, "both streams' first tokens")
    assert not errors, errors
    kv = [p.metric("chunkserve:kv_transfers_completed_total") - k
          for p, k in zip(cluster.decode, kv0)]
    assert sorted(kv) == [0, 1], kv  # the long prompt's pages went to one decode worker
    victim = cluster.decode[kv.index(1)]
    got_bytes = victim.metric("chunkserve:kv_transfer_bytes_total") - bytes0[kv.index(1)]
    want_bytes, every_page = window_aware_bytes(wants[0][3][0])
    print(f"{wants[0][3][0]}-token prompt: {got_bytes / 2**20:.1f} MiB of KV sent, "
          f"{every_page / 2**20:.1f} MiB with every page")
    assert got_bytes == want_bytes, (got_bytes, want_bytes, every_page)
    at_kill = list(progress)
    victim.kill9()
    assert progress[0] < ns[0], f"the long stream finished before the kill: {at_kill}"
    for t in threads:
        t.join(600)
    check_migrated(wants, got, errors, ns, f"killed at {at_kill}")
    assert metric(cluster.router.metrics(), "chunkserve:migrations_total") - mig0 >= 1
    victim.start(port=victim.port)
    cluster.wait_usable(1, 2)
    cluster.wait_idle()
