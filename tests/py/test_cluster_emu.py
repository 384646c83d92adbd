"""The GPU cluster path on the CPU (CTest `cluster_emu`, marker `emu`).

chunkserve-prefill and chunkserve-decode built against the emulated CUDA backend
(tests/emu: the CUDA kernels' own source under a SIMT emulator, "device" memory in host
memory) move KV pages with the transport's NCCL payload (kvx/src/kvx_payload_nccl.c:
device staging slots, the kv_pack gather/scatter kernels, their checksums) over
tests/emu/nccl_emu.c, NCCL's calls between two processes on a loopback connection. The
router is the real one. What comes back must be exactly the tokens of one process on the
same emulated backend (`chunkserve serve` built the same way).

Environment: CHUNKSERVE_BIN_DIR (the router, chunkserve-mktiny) and CHUNKSERVE_EMU_BIN_DIR
(the emulated builds; default: bin-emu beside CHUNKSERVE_BIN_DIR).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_tools.protoc")  # stubs: conftest.proto_modules

from cluster_harness import (Proc, Reference, generate, make_tiny, metric, wait_for,  # noqa: E402
                             wait_metric)

pytestmark = pytest.mark.emu

WORKER = ["--port=0", "--kv-cache-mib=16", "--threads=1", "--grace-ms=2000"]
# Chunks of 16 tokens, one page each: a prompt's KV leaves in several transfers per prompt,
# while the next chunk computes.
PREFILL = ["--max-batched-tokens=64", "--max-chunk-tokens=16"]
PROMPTS = [[5, 6, 7], list(range(20, 60)), [(i * 7) % 300 + 3 for i in range(100)],
           list(range(3, 35))]
N = 12


@pytest.fixture(scope="module")
def pb(proto_modules):
    return type("PB", (), proto_modules)


@pytest.fixture(scope="module")
def emu_bins(bin_dir):
    d = Path(os.environ.get("CHUNKSERVE_EMU_BIN_DIR", bin_dir.parent / "bin-emu"))
    for b in ("chunkserve", "chunkserve-prefill", "chunkserve-decode"):
        if not (d / b).is_file():
            pytest.fail(f"{d / b} not built (the emulated CUDA build: tests/emu, needs a C++ "
                        "compiler)")
    return d


@pytest.fixture(scope="module")
def cuda_env():
    """Every process started from here picks the (emulated) CUDA backend or fails."""
    old = os.environ.get("CHUNKSERVE_BACKEND")
    os.environ["CHUNKSERVE_BACKEND"] = "cuda"
    yield
    if old is None:
        del os.environ["CHUNKSERVE_BACKEND"]
    else:
        os.environ["CHUNKSERVE_BACKEND"] = old


@pytest.fixture(scope="module")
def model(bin_dir, tmp_path_factory):
    return make_tiny(bin_dir, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(emu_bins, model, pb, cuda_env):
    ref = Reference(emu_bins / "chunkserve", model, pb)
    yield ref
    ref.stop()


class Procs:
    def __init__(self, pb):
        self.pb, self.all, self.channels = pb, [], []

    def start(self, exe: Path, args, name):
        p = Proc(exe, args, name)
        self.all.append(p)
        return p

    def router(self, bin_dir, model, prefill, decode):
        r = self.start(bin_dir / "chunkserve-router",
                       [f"--model={model}", "--port=0", "--grace-ms=2000",
                        "--status-interval-ms=100", "--local-prefill-threshold=1",
                        f"--prefill-workers={prefill.addr}",
                        f"--decode-workers={decode.addr}"], "router")
        ch = grpc.insecure_channel(r.addr)
        self.channels.append(ch)
        r.stub = self.pb.generation_pb2_grpc.GenerationStub(ch)
        return r

    def stop(self):
        for ch in self.channels:
            ch.close()
        errs = []
        for p in reversed(self.all):  # the router first
            rc, err = p.stop(), p.stderr()
            if rc != (-9 if p.killed else 0) or "Sanitizer" in err or "runtime error:" in err:
                errs.append(f"{p.name} exit {rc}: {err[-4000:]}")
        assert not errs, "\n".join(errs)


@pytest.fixture
def procs(pb, cuda_env):
    p = Procs(pb)
    yield p
    p.stop()


def status(pb, p: Proc):
    ch = grpc.insecure_channel(p.addr)
    try:
        return pb.cluster_pb2_grpc.WorkerStub(ch).GetStatus(pb.cluster_pb2.WorkerStatusRequest(),
                                                            timeout=10)
    finally:
        ch.close()


def run_all(stub, g, prompts, n):
    """Every prompt at once; the ids of each stream, in prompt order."""
    out, errs = [None] * len(prompts), []

    def one(i):
        try:
            ids, _, finish, _ = generate(stub, g, ids=prompts[i], max_tokens=n, timeout=600,
                                         ignore_eos=True)
            assert finish == g.FINISH_REASON_LENGTH
            out[i] = ids
        except Exception as e:  # noqa: BLE001 - reported below with the prompt
            errs.append(f"prompt {i}: {e!r}")

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(900)
    assert not errs, errs
    return out


def test_gpu_cluster_path_gives_single_process_tokens(bin_dir, emu_bins, model, pb, reference,
                                                      procs):
    prefill = procs.start(emu_bins / "chunkserve-prefill", [f"--model={model}", *WORKER, *PREFILL],
                          "prefill")
    decode = procs.start(emu_bins / "chunkserve-decode", [f"--model={model}", *WORKER], "decode")
    c = pb.cluster_pb2
    for p in (prefill, decode):
        s = status(pb, p)
        assert (s.kv_transport, s.kv_dtype) == (c.KV_TRANSPORT_NCCL, c.KV_DTYPE_BF16), \
            f"{p.name}: {s}"
        assert "cuda backend" in p.stderr(), p.stderr()[-2000:]
    assert status(pb, prefill).kv_layout_fingerprint == status(pb, decode).kv_layout_fingerprint
    r = procs.router(bin_dir, model, prefill, decode)
    wait_for(lambda: metric(r.metrics(), "chunkserve:workers_usable", 'role="prefill"') == 1 and
             metric(r.metrics(), "chunkserve:workers_usable", 'role="decode"') == 1, 60,
             "the router to see both workers")

    want = [reference(p, N)[0] for p in PROMPTS]
    got = run_all(r.stub, pb.generation_pb2, PROMPTS, N)
    for p, w, g in zip(PROMPTS, want, got):
        assert g == w, f"prompt of {len(p)} tokens: cluster {g} != one process {w}"

    # Every prompt went through the prefill worker and its pages over the NCCL payload:
    # several chunks per long prompt, every transfer acknowledged, none failed.
    wait_metric(prefill, "chunkserve:kv_transfers_completed_total", "", len(PROMPTS))
    rm, pm = r.metrics(), prefill.metrics()
    assert metric(rm, "chunkserve:prefills_total", 'path="remote"') == len(PROMPTS), rm
    assert metric(pm, "chunkserve:kv_transfers_completed_total") == len(PROMPTS), pm
    assert metric(pm, "chunkserve:kv_transfers_failed_total") == 0, pm
    page_bytes = 2 * 2 * 16 * 2 * 16 * 2  # layers * (K,V) * page tokens * kv heads * head dim * bf16
    pages = sum((len(p) - 1) // 16 + 1 for p in PROMPTS)
    # (a prompt's last page may stay behind: its last token is the decode worker's to compute)
    assert metric(pm, "chunkserve:kv_transfer_bytes_total") >= (pages - len(PROMPTS)) * page_bytes
    assert "channel to 127.0.0.1" in prefill.stderr() and "open, nccl payload" in prefill.stderr()
    assert "open, nccl payload" in decode.stderr()

    # Afterwards both pools are whole again.
    def idle():
        return all(s.kv_pages_free == s.kv_pages_total and not s.num_running
                   for s in (status(pb, prefill), status(pb, decode)))
    wait_for(idle, 30, "every KV page free on both workers")


def test_cpu_prefill_is_never_paired_with_a_gpu_decode(bin_dir, emu_bins, model, pb, reference,
                                                       procs):
    """A CPU prefill worker (TCP payload, fp32 pages) and a GPU decode worker (NCCL, bf16)
    cannot share KV: the router never sends the decode worker's prompts to it; the decode
    worker prefills them itself, with the same tokens."""
    os.environ["CHUNKSERVE_BACKEND"] = "cpu"
    try:
        prefill = procs.start(bin_dir / "chunkserve-prefill",
                              [f"--model={model}", *WORKER, *PREFILL], "cpu-prefill")
    finally:
        os.environ["CHUNKSERVE_BACKEND"] = "cuda"
    decode = procs.start(emu_bins / "chunkserve-decode", [f"--model={model}", *WORKER], "decode")
    c = pb.cluster_pb2
    assert status(pb, prefill).kv_transport == c.KV_TRANSPORT_TCP
    assert status(pb, decode).kv_transport == c.KV_TRANSPORT_NCCL
    r = procs.router(bin_dir, model, prefill, decode)
    wait_for(lambda: metric(r.metrics(), "chunkserve:workers_usable", 'role="decode"') == 1, 60,
             "the router to see the decode worker")
    want = [reference(p, N)[0] for p in PROMPTS[:2]]
    got = run_all(r.stub, pb.generation_pb2, PROMPTS[:2], N)
    assert got == want
    rm = r.metrics()
    assert metric(rm, "chunkserve:prefills_total", 'path="remote"') == 0, rm
    assert metric(rm, "chunkserve:prefills_total", 'path="local"') == 2, rm
    assert metric(prefill.metrics(), "chunkserve:prefill_requests_total") == 0


def test_prefill_killed_mid_transfer_frees_the_gpu_pages(bin_dir, emu_bins, model, pb, reference,
                                                        procs):
    """kill -9 of the prefill worker while its pages stream over the NCCL payload: the
    decode worker's link fails (the stand-in's connection closes, as NCCL reports a remote
    error), the reserved pages come back, and the request still ends with the
    single-process tokens (the router's retry contract)."""
    prefill = procs.start(emu_bins / "chunkserve-prefill", [f"--model={model}", *WORKER, *PREFILL],
                          "prefill")
    decode = procs.start(emu_bins / "chunkserve-decode", [f"--model={model}", *WORKER], "decode")
    r = procs.router(bin_dir, model, prefill, decode)
    wait_for(lambda: metric(r.metrics(), "chunkserve:workers_usable", 'role="prefill"') == 1, 60,
             "the router to see the prefill worker")
    prompt = [(i * 13) % 300 + 3 for i in range(400)]
    want = reference(prompt, N)[0]
    out = {}
    t = threading.Thread(target=lambda: out.update(res=generate(
        r.stub, pb.generation_pb2, ids=prompt, max_tokens=N, timeout=600, ignore_eos=True)))
    t.start()
    wait_for(lambda: metric(prefill.metrics(), "chunkserve:kv_transfer_bytes_total") > 0, 120,
             "the first KV chunk on its way")
    prefill.kill9()
    t.join(600)
    assert out["res"][0] == want
    wait_for(lambda: (lambda s: s.kv_pages_free == s.kv_pages_total and not s.num_running)(
        status(pb, decode)), 30, "every KV page free on the decode worker")
    err = decode.stderr()
    # The decode side learns of the death from whichever it reads first: the control
    # connection closing, or the payload's receive failing (NCCL reports the remote error).
    assert "open, nccl payload" in err and "KV transfer" in err, err[-3000:]
    assert "closed the channel" in err or "nccl receive from" in err, err[-3000:]
    assert "retrying (1/3)" in r.stderr(), r.stderr()[-3000:]
