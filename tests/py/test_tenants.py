"""Tenants (issue 41): `chunkserve serve` on the default model, requests naming their tenant in
GenerateRequest.tenant (gRPC) or the X-Chunkserve-Tenant header (OpenAI door), or by their API
key (--api-key-file lines "KEY TENANT"), shares from --tenant-shares. The scheduler's token-fair steps are asserted in test_sched (the shares over
many steps); here, through real processes: a tenant flooding the queue with long prompts does
not keep another tenant's request waiting behind the flood (an order, not a speed), and bad
tenants and shares are refused by name."""
from __future__ import annotations

import subprocess

import pytest

grpc = pytest.importorskip("grpc")
openai = pytest.importorskip("openai")

from cluster_harness import Flood, wait_for  # noqa: E402
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


def flood_then_chat(served, flood_tenant: dict, flood_metadata, chat):
    """FLOOD long prompts of one tenant queue up; then chat() asks as another. Returns how many
    of the flood had finished when the chat's answer came."""
    f = Flood(served.stub, served.pb.generation_pb2, FLOOD, FLOOD_TOKENS,
              metadata=flood_metadata, **flood_tenant)
    # every flood request queued or running before the other tenant asks
    wait_for(lambda: served.status().num_running + served.status().num_waiting >= FLOOD or f.errors,
             60, "the flood queued")
    r = chat()
    flood_done_before = f.n_done()
    f.join()
    assert r.choices[0].finish_reason == "length"
    assert len(f.done) == FLOOD
    return flood_done_before


def test_a_flooding_tenant_does_not_hold_back_another(served):
    before = flood_then_chat(
        served, {"tenant": "flood"}, None,
        lambda: served.client.completions.create(model=served.model, prompt="hello there",
                                                 max_tokens=4, temperature=0,
                                                 extra_headers={"X-Chunkserve-Tenant": "chat"}))
    # arrival order would put it behind all six (each 1,000 tokens in 64-token steps)
    assert before <= FLOOD // 2, f"{before} of the flood finished first"


def test_the_status_says_the_queue_by_tenant(served, chunkserve_bin, tiny_model, pb):
    """GetStatus.queued_prompts: what a router predicts a request's share from. The named
    shares come as groups of 0 tokens (their weights), a flood as its tenant's tokens."""
    s = Serve(chunkserve_bin, tiny_model, pb, "--tenant-shares", "a=3,b=0.5")
    try:
        groups = {(q.tenant, q.priority): (q.tokens, q.weight) for q in s.status().queued_prompts}
        assert groups == {("a", 0): (0, 3.0), ("b", 0): (0, 0.5)}, groups
        assert s.status().queued_unsorted_tokens == 0
    finally:
        s.stop()  # asserts a clean exit
    f = Flood(served.stub, served.pb.generation_pb2, FLOOD, FLOOD_TOKENS, tenant="flood")
    try:
        seen = wait_for(lambda: {q.tenant: q.tokens for q in served.status().queued_prompts}
                        .get("flood", 0) >= FLOOD_TOKENS or f.errors, 60, "the flood in the status")
        assert seen is True, f.errors
        tokens = {q.tenant: q.tokens for q in served.status().queued_prompts}
        assert tokens.get("chat") == 0 and tokens["flood"] <= FLOOD * FLOOD_TOKENS, tokens
    finally:
        f.join()
    assert not f.errors, f.errors


def key_tenant(key: str) -> str:
    """The tenant of a key its file line names none for: key- and 8 hex digits of its FNV-1a."""
    h = 0xcbf29ce484222325
    for b in key.encode():
        h = ((h ^ b) * 0x100000001b3) & (2**64 - 1)
    return f"key-{h >> 32:08x}"


def test_the_api_key_names_the_tenant(chunkserve_bin, model_path, pb, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# key tenant\nflood-key-0123 flood\nflood-key-4567\tflood\n"
                    "chat-key-0123 chat\nsolo-key-0123\n")
    s = Serve(chunkserve_bin, model_path, pb, "--max-queue", "64", "--max-batched-tokens", "64",
              "--api-key-file", str(keys), "--tenant-shares", "flood=1,chat=1",
              api_key="chat-key-0123")
    try:
        g = pb.generation_pb2
        s.model = s.client.models.list().data[0].id

        def ask(key, tenant=None, client=None):
            c = openai.OpenAI(base_url=f"http://{s.http}/v1", api_key=key, max_retries=0)
            return c.completions.create(model=s.model, prompt="hi", max_tokens=2,
                                        extra_headers={"X-Chunkserve-Tenant": tenant} if tenant else None)

        # a request may name its key's tenant, no other
        assert ask("chat-key-0123", "chat").usage.completion_tokens >= 1
        assert ask("flood-key-4567", "flood").usage.completion_tokens >= 1
        assert ask("solo-key-0123", key_tenant("solo-key-0123")).usage.completion_tokens >= 1
        for key, other in (("chat-key-0123", "flood"), ("solo-key-0123", "chat"),
                           ("flood-key-0123", key_tenant("solo-key-0123"))):
            with pytest.raises(openai.PermissionDeniedError) as e:
                ask(key, other)
            assert e.value.status_code == 403 and e.value.body["param"] == "tenant", e.value.body
            assert f"tenant '{other}' is not the API key's" in e.value.body["message"]
        with pytest.raises(grpc.RpcError) as e:
            list(s.stub.Generate(g.GenerateRequest(prompt="hi", tenant="chat"), timeout=30,
                                 metadata=[("authorization", "Bearer flood-key-0123")]))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
        # the keys alone, naming no tenant, put the flood and the chat in their tenants: the
        # chat's answer does not wait for the flood
        before = flood_then_chat(
            s, {}, [("authorization", "Bearer flood-key-0123")],
            lambda: s.client.completions.create(model=s.model, prompt="hello there",
                                                max_tokens=4, temperature=0))
        assert before <= FLOOD // 2, f"{before} of the flood finished first"
    finally:
        s.stop()


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


@pytest.mark.parametrize("lines, says", [
    ("long-key-0123 team a\n", "a line is KEY or KEY TENANT: this one has more fields"),
    ("long-key-0123 a\nlong-key-0123 b\n", "an API key is given twice"),
    ("long-key-0123 " + "t" * 65 + "\n", "a tenant name has 65 bytes"),
    ("short a\n", "an API key has 5 bytes"),
])
def test_bad_key_files_stop_the_server_at_start(chunkserve_bin, tiny_model, tmp_path, lines, says):
    keys = tmp_path / "keys"
    keys.write_text(lines)
    p = subprocess.run([str(chunkserve_bin), "serve", "--model", str(tiny_model), "--port", "0",
                        "--api-key-file", str(keys)], capture_output=True, timeout=60)
    assert p.returncode != 0
    err = p.stderr.decode()
    assert "--api-key-file" in err and says in err, err
    assert "long-key-0123" not in err and "short" not in err  # never a key in a message
