"""Tenants (issue 41): `chunkserve serve` on the default model, requests naming their tenant in
GenerateRequest.tenant (gRPC) or the X-Chunkserve-Tenant header (OpenAI door), shares from
--tenant-shares. The scheduler's token-fair steps are asserted in test_sched (the shares over
many steps); here, through real processes: a tenant flooding the queue with long prompts does
not keep another tenant's request waiting behind the flood (an order, not a speed), and bad
tenants and shares are refused by name."""
from __future__ import annotations

import subprocess
import threading

import pytest

grpc = pytest.importorskip("grpc")
openai = pytest.importorskip("openai")

from cluster_harness import wait_for  # noqa: E402
from test_openai import Serve, pb, tiny_model  # noqa: E402,F401  (fixtures)

FLOOD, FLOOD_TOKENS = 6, 1000


@pytest.fixture(scope="module")
def served(chunkserve_bin, model_path, pb):
    # the real model (the tiny one would finish the flood before the other tenant asks) and a
    # small step budget: the flood's prompts take many steps each
    s = Serve(chunkserve_bin, model_path, pb, "--max-queue", "64", "--max-batched-tokens", "64",
              "--tenant-shares", "flood=1,chat=1")
    yield s
    s.stop()


def test_a_flooding_tenant_does_not_hold_back_another(served):
    g = served.pb.generation_pb2
    done: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def flood(i):
        try:
            req = g.GenerateRequest(token_ids=g.TokenIds(ids=[(7 * i + k) % 300 + 3
                                                             for k in range(FLOOD_TOKENS)]),
                                    sampling=g.SamplingParams(max_tokens=2, ignore_eos=True),
                                    tenant="flood")
            list(served.stub.Generate(req, timeout=300))
            with lock:
                done.append(f"flood-{i}")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(FLOOD)]
    for t in threads:
        t.start()
    # every flood request queued or running before the other tenant asks
    wait_for(lambda: served.status().num_running + served.status().num_waiting >= FLOOD or errors,
             60, "the flood queued")
    r = served.client.completions.create(model=served.model, prompt="hello there", max_tokens=4,
                                         temperature=0,
                                         extra_headers={"X-Chunkserve-Tenant": "chat"})
    with lock:
        flood_done_before = len(done)
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert r.choices[0].finish_reason == "length"
    # arrival order would put it behind all six (each 1,000 tokens in 64-token steps)
    assert flood_done_before <= FLOOD // 2, f"{flood_done_before} of the flood finished first"
    assert len(done) == FLOOD


def test_the_answer_does_not_depend_on_the_tenant(served):
    base = served.client.completions.create(model=served.model, prompt="one two three",
                                            max_tokens=6, temperature=0)
    for t in ("flood", "chat", "someone-else"):
        r = served.client.completions.create(model=served.model, prompt="one two three",
                                             max_tokens=6, temperature=0,
                                             extra_headers={"X-Chunkserve-Tenant": t})
        assert r.choices[0].text == base.choices[0].text


def test_a_bad_tenant_is_refused_by_name(served):
    long = "t" * 65
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(model=served.model, prompt="hi", max_tokens=2,
                                         extra_headers={"X-Chunkserve-Tenant": long})
    assert e.value.body["param"] == "tenant", e.value.body
    g = served.pb.generation_pb2
    with pytest.raises(grpc.RpcError) as e:
        list(served.stub.Generate(g.GenerateRequest(prompt="hi", tenant=long), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tenant" in e.value.details()


@pytest.mark.parametrize("shares, says", [("a", "is not NAME=WEIGHT"),
                                          ("a=0", "the weight must be in [0.001, 1e6]"),
                                          ("a=1,a=2", "tenant 'a' is named twice"),
                                          ("=3", "is not NAME=WEIGHT")])
def test_bad_shares_stop_the_server_at_start(chunkserve_bin, tiny_model, shares, says):
    p = subprocess.run([str(chunkserve_bin), "serve", "--model", str(tiny_model), "--port", "0",
                        "--tenant-shares", shares], capture_output=True, timeout=60)
    assert p.returncode != 0
    err = p.stderr.decode()
    assert "--tenant-shares" in err and says in err, err
