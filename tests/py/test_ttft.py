"""The TTFT predictor and early refusal (issue 41, item 3): `chunkserve serve` on the default model
with --ttft-slo-ms. A request whose predicted time to first token (the work queued ahead over the
step model's prefill rate) is over its priority's bound is refused at once with RESOURCE_EXHAUSTED
and google.rpc.RetryInfo (gRPC) or 429 + Retry-After (OpenAI door); one of a priority with a
looser bound is admitted behind the same queue and gets its prediction in its usage; once the
queue drains the refused one is admitted. What is asserted is the rule, not a speed: the queue
ahead (6,000 prompt tokens in 64-token steps) is far over the 100 ms bound on any CPU."""
from __future__ import annotations

import subprocess
import threading
import urllib.request

import pytest

grpc = pytest.importorskip("grpc")
openai = pytest.importorskip("openai")
status_pb2 = pytest.importorskip("google.rpc.status_pb2")
error_details_pb2 = pytest.importorskip("google.rpc.error_details_pb2")

from cluster_harness import wait_for  # noqa: E402
from test_openai import Serve, pb, tiny_model  # noqa: E402,F401  (fixtures)

FLOOD, FLOOD_TOKENS = 6, 1000


def metrics(s) -> dict:
    with urllib.request.urlopen(f"http://{s.ops}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                     if line and not line.startswith("#"))}


def retry_info(err: grpc.RpcError):
    """The RetryInfo of a refusal's google.rpc.Status (the grpc-status-details-bin trailer)."""
    md = dict(err.trailing_metadata() or ())
    st = status_pb2.Status.FromString(md["grpc-status-details-bin"])
    assert st.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and st.message == err.details()
    info = error_details_pb2.RetryInfo()
    assert len(st.details) == 1 and st.details[0].Unpack(info), st
    return info


def test_a_request_over_its_bound_is_refused_early(chunkserve_bin, model_path, pb):
    s = Serve(chunkserve_bin, model_path, pb, "--max-queue", "64", "--max-batched-tokens", "64",
              "--ttft-slo-ms", "0=600000,100")
    try:
        g = pb.generation_pb2
        # the step model fits from steps of different sizes: prompts of 40..400 tokens
        for n in (40, 80, 160, 320, 400):
            list(s.stub.Generate(g.GenerateRequest(
                token_ids=g.TokenIds(ids=[(5 * k) % 300 + 3 for k in range(n)]),
                sampling=g.SamplingParams(max_tokens=4, ignore_eos=True)), timeout=120))
        wait_for(lambda: metrics(s).get("chunkserve:prefill_capacity_tokens_per_second", 0) > 0,
                 30, "the step model fitted")
        # alone, a short request of priority 5 is admitted (its bound is 100 ms)
        quick = g.GenerateRequest(prompt="hello there",
                                  sampling=g.SamplingParams(max_tokens=2, priority=5))
        assert list(s.stub.Generate(quick, timeout=60))[-1].finish_reason

        errors: list[BaseException] = []

        def flood(i):
            try:
                req = g.GenerateRequest(token_ids=g.TokenIds(ids=[(7 * i + k) % 300 + 3
                                                                 for k in range(FLOOD_TOKENS)]),
                                        sampling=g.SamplingParams(max_tokens=2, ignore_eos=True))
                list(s.stub.Generate(req, timeout=300))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=flood, args=(i,)) for i in range(FLOOD)]
        for t in threads:
            t.start()
        wait_for(lambda: s.status().num_running + s.status().num_waiting >= FLOOD or errors, 60,
                 "the flood queued")
        # priority 5 behind 6,000 prompt tokens: refused at once, with when to retry
        with pytest.raises(grpc.RpcError) as e:
            list(s.stub.Generate(quick, timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert "predicted time to first token" in e.value.details()
        assert "--ttft-slo-ms" in e.value.details()
        delay = retry_info(e.value).retry_delay
        assert delay.seconds * 1000 + delay.nanos // 1000000 > 0
        with pytest.raises(openai.RateLimitError) as e:
            s.client.completions.create(model=s.model, prompt="hello there", max_tokens=2,
                                        extra_body={"priority": 5})
        assert e.value.status_code == 429
        assert int(e.value.response.headers["retry-after"]) >= 1
        # priority 0 (bound 600 s) is admitted behind the same queue, its prediction in its usage
        last = list(s.stub.Generate(g.GenerateRequest(
            prompt="hello there", sampling=g.SamplingParams(max_tokens=2)), timeout=300))[-1]
        assert last.finish_reason and last.usage.predicted_ttft_seconds > 0.1
        for t in threads:
            t.join(300)
        assert not errors, errors
        # the queue drained: the refused request is admitted now
        assert list(s.stub.Generate(quick, timeout=60))[-1].finish_reason
        m = metrics(s)
        assert m["chunkserve:requests_refused_ttft_total"] == 2
        assert m["chunkserve:ttft_prediction_error_ratio_count"] >= FLOOD + 2
    finally:
        s.stop()


@pytest.mark.parametrize("spec, says", [("0", "the bound must be milliseconds in (0, 1e7]"),
                                        ("x=5", "the priority must be an integer"),
                                        ("1=5,1=6", "the priority is named twice"),
                                        ("5,6", "a second bound for every priority"),
                                        ("-1=5", "the priority must be an integer")])
def test_bad_bounds_stop_the_server_at_start(chunkserve_bin, tiny_model, spec, says):
    p = subprocess.run([str(chunkserve_bin), "serve", "--model", str(tiny_model), "--port", "0",
                        "--ttft-slo-ms", spec], capture_output=True, timeout=60)
    assert p.returncode != 0
    err = p.stderr.decode()
    assert "--ttft-slo-ms" in err and says in err, err
