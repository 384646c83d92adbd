"""Refusals that name their field: GenerateRequest cases and the chunkserve-field trailer they
must carry (test_serve: `chunkserve serve`; test_router: the router's own door)."""
from __future__ import annotations

import grpc
import pytest

TINY_CTX = 4096  # the tiny test model's context

FIELD_CASES = [
    # (fields of GenerateRequest, the chunkserve-field trailer)
    (dict(prompt="x", sampling=dict(top_p=1.5)), "sampling.top_p"),
    (dict(prompt="x", sampling=dict(top_k=-1)), "sampling.top_k"),
    (dict(prompt="x", sampling=dict(top_logprobs=3)), "sampling.top_logprobs"),
    (dict(prompt="x", sampling=dict(max_tokens=2, min_tokens=3)), "sampling.min_tokens"),
    (dict(prompt="x", sampling=dict(stop_token_ids=[400])), "sampling.stop_token_ids"),
    (dict(prompt="x", sampling=dict(logit_bias_ids=[1], logit_bias_values=[101])),
     "sampling.logit_bias_values"),
    (dict(token_ids=dict(ids=[5, 349])), "token_ids.ids"),
    (dict(token_ids=dict(ids=[5] * TINY_CTX)), "context"),
    (dict(prompt=""), "prompt"),
    (dict(model="gpt-9", prompt="x"), "model"),
    (dict(chat=dict(messages=[dict(role="robot", content="x")])), "chat"),
]


def generate_request(pb, fields):
    """GenerateRequest(**fields), its nested messages given as dicts."""
    g = pb.generation_pb2
    f = dict(fields)
    if "sampling" in f:
        f["sampling"] = g.SamplingParams(**f["sampling"])
    if "token_ids" in f:
        f["token_ids"] = g.TokenIds(**f["token_ids"])
    if "chat" in f:
        f["chat"] = g.Chat(messages=[g.ChatMessage(**m) for m in f["chat"]["messages"]])
    return g.GenerateRequest(**f)


def refusal_field(stub, pb, fields):
    """The INVALID_ARGUMENT refusal of GenerateRequest(**fields): its chunkserve-field trailer."""
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(generate_request(pb, fields), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return dict(e.value.trailing_metadata() or ()).get("chunkserve-field")
