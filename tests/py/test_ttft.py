"""The TTFT predictor and early refusal (issue 41, item 3): `chunkserve serve` on the default model
with --ttft-slo-ms. A request whose predicted time to first token (the work queued ahead over the
step model's prefill rate) is over its priority's bound is refused at once with RESOURCE_EXHAUSTED
and google.rpc.RetryInfo (gRPC) or 429 + Retry-After (OpenAI door); one of a priority with a
looser bound is admitted behind the same queue and gets its prediction in its usage; once the
queue drains the refused one is admitted. The router does the same from its workers' queues.
What is asserted is the rule, not a speed: the queue
ahead (6,000 prompt tokens in 64-token steps) is far over the 100 ms bound on any CPU."""
from __future__ import annotations

import re
import statistics
import subprocess
import time
import urllib.request

import pytest

grpc = pytest.importorskip("grpc")
openai = pytest.importorskip("openai")
status_pb2 = pytest.importorskip("google.rpc.status_pb2")
error_details_pb2 = pytest.importorskip("google.rpc.error_details_pb2")

from cluster_harness import Cluster, Flood, Proc, metric, wait_for  # noqa: E402
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


def slo_router(bin_dir, model_path, c, bound_ms):
    """A second router in front of cluster c's workers with --ttft-slo-ms=bound_ms (its own
    process, stopped by the caller)."""
    return Proc(bin_dir / "chunkserve-router", [
        f"--model={model_path}", "--port=0", "--status-interval-ms=100", "--grace-ms=3000",
        f"--decode-workers={c.decode[0].addr}", f"--prefill-workers={c.prefill[0].addr}",
        f"--ttft-slo-ms={bound_ms}"], "router-slo")


def slo_stub(slo, pb):
    """A Generation stub on slo once it reaches both workers."""
    wait_for(lambda: metric(slo.metrics(), "chunkserve:workers_usable", 'role="prefill"') == 1 and
             metric(slo.metrics(), "chunkserve:workers_usable", 'role="decode"') == 1, 30,
             "the second router to reach both workers")
    return pb.generation_pb2_grpc.GenerationStub(grpc.insecure_channel(slo.addr))


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

        f = Flood(s.stub, g, FLOOD, FLOOD_TOKENS)
        wait_for(lambda: s.status().num_running + s.status().num_waiting >= FLOOD or f.errors, 60,
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
        f.join()
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


def test_the_router_refuses_early_from_the_workers_queues(bin_dir, model_path, pb):
    """The router predicts from the prefill workers' queued prompt tokens and reported prefill
    rates (WorkerStatus.prefill_tokens_per_second), places by it, and refuses the same way."""
    c = Cluster(bin_dir, model_path, pb, n_prefill=1, n_decode=1,
                router_args=["--ttft-slo-ms=0=600000,100"], prefill_args=["--max-batched-tokens=64"])
    try:
        g = pb.generation_pb2

        def ids(n, seed):
            return g.TokenIds(ids=[(seed * 7 + k) % 300 + 3 for k in range(n)])

        for i, n in enumerate((520, 700, 900)):  # remote prefills: the prefill worker's model fits
            list(c.stub.Generate(g.GenerateRequest(token_ids=ids(n, i), sampling=g.SamplingParams(
                max_tokens=2, ignore_eos=True)), timeout=120))
        wait_for(lambda: c.status(c.prefill[0]).prefill_tokens_per_second > 0, 30,
                 "the prefill worker reports its rate")
        f = Flood(c.stub, g, FLOOD, FLOOD_TOKENS, seed=10)
        wait_for(lambda: c.status(c.prefill[0]).queued_prefill_tokens >= 3 * FLOOD_TOKENS
                 or f.errors, 60, "the flood queued on the prefill worker")
        # refused, not prefilled on the decode worker instead: it has computed no prompt
        # yet, so it reports no prefill rate to predict by (the last test of this file)
        late = g.GenerateRequest(token_ids=ids(600, 99),
                                 sampling=g.SamplingParams(max_tokens=2, priority=5))
        with pytest.raises(grpc.RpcError) as e:
            list(c.stub.Generate(late, timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert "the workers are busy" in e.value.details()
        delay = retry_info(e.value).retry_delay
        assert delay.seconds * 1000 + delay.nanos // 1000000 > 0
        last = list(c.stub.Generate(g.GenerateRequest(token_ids=ids(600, 98), sampling=g.SamplingParams(
            max_tokens=2)), timeout=300))[-1]
        assert last.finish_reason and last.usage.predicted_ttft_seconds > 0.1
        f.join()
        c.wait_idle()
        # the router's view of the queue is as old as its last status poll: follow RetryInfo
        refused = 1
        for _ in range(20):
            try:
                assert list(c.stub.Generate(late, timeout=120))[-1].finish_reason
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                d = retry_info(e).retry_delay
                refused += 1
                time.sleep(d.seconds + d.nanos / 1e9)
        else:
            pytest.fail("still refused with the workers idle")
        m = c.router.metrics()
        assert metric(m, "chunkserve:requests_refused_ttft_total") == refused
        assert metric(m, "chunkserve:ttft_prediction_error_ratio_count") >= FLOOD + 2

        # What the queue model leaves out (the hops, the step under way, a step's fixed cost)
        # is learnt from measured first tokens. A short prompt's queue part (its few tokens over
        # the rate) leaves much of its time out: without the rest learnt, the predictions' median
        # was 41% under the measured one here. Both come from the router's log line of each
        # request (from its receipt to its first token relayed). Compared as medians: on a
        # 2-core machine one descheduled process makes a first token several times its usual,
        # and how many such spikes come is the machine's, not the predictor's (the medians
        # within 5% here when it is quiet, within 11% with a busy loop beside it, 5 runs each).
        # Under is held at 25% (the rest not learnt); over at 60%: the router reads the
        # worker's queue from a status up to one poll old, and a short placed just after
        # another can be predicted with the worker busy (its busy rest, learnt during the
        # flood): one full run in about fifteen read a median 22 ms against 15 measured.
        def short(k):  # a local prefill on the decode worker: its request id
            out = list(c.stub.Generate(g.GenerateRequest(token_ids=ids(16, 200 + k), sampling=(
                g.SamplingParams(max_tokens=2, ignore_eos=True))), timeout=60))
            return out[0].request_id

        def logged(rid):  # (predicted, measured) TTFT in the router's log
            m = re.search(rf"request {rid}: OK, .*\(ttft ([0-9.]+) s, predicted ([0-9.]+) s",
                          c.router.stderr())
            assert m, f"no log line for {rid}"
            return float(m.group(2)), float(m.group(1))
        short(0)  # its rate comes with its first prompt steps
        wait_for(lambda: c.status(c.decode[0]).prefill_tokens_per_second > 0, 30,
                 "the decode worker reports its rate")
        time.sleep(0.5)  # the router's next poll
        for k in range(3):  # the first predicted ones teach the router the rest
            short(1 + k)
        n0 = metric(c.router.metrics(), "chunkserve:ttft_prediction_error_ratio_count")
        rids = [short(4 + k) for k in range(12)]
        assert metric(c.router.metrics(), "chunkserve:ttft_prediction_error_ratio_count") - n0 == 12
        wait_for(lambda: all(f"request {rid}: OK" in c.router.stderr() for rid in rids), 30,
                 "the router to log the twelve")
        seen = [logged(rid) for rid in rids]
        predicted = statistics.median(p for p, _ in seen)
        measured = statistics.median(m for _, m in seen)
        assert 0.75 * measured < predicted < 1.6 * measured, seen
    finally:
        c.stop()


def test_the_router_refuses_by_tenant(bin_dir, model_path, pb):
    """The workers report their queues by (priority, tenant) (WorkerStatus.queued_prompts); the
    router predicts a request's share as the worker's token-fair steps serve it: behind another
    tenant's flood a request waits for its own tokens and as many of the flood's, not for the
    whole flood. With a bound between the two, the flood's tenant is refused and the other is
    served. (With the queue's sum alone, both would be refused.)"""
    c = Cluster(bin_dir, model_path, pb, n_prefill=1, n_decode=1,
                prefill_args=["--max-batched-tokens=64"])
    slo = None
    try:
        g = pb.generation_pb2

        def request(n, seed, tenant):
            return g.GenerateRequest(token_ids=g.TokenIds(ids=[(seed * 7 + k) % 300 + 3 for k in range(n)]),
                                     sampling=g.SamplingParams(max_tokens=2, ignore_eos=True),
                                     tenant=tenant)

        for i, n in enumerate((520, 700, 900)):  # remote prefills: the prefill worker's model fits
            list(c.stub.Generate(request(n, i, ""), timeout=120))
        wait_for(lambda: c.status(c.prefill[0]).prefill_tokens_per_second, 30,
                 "the prefill worker reports its rate")
        own = 600
        f = Flood(c.stub, g, FLOOD + 2, FLOOD_TOKENS, seed=20, tenant="flood")

        def flood_queued():
            s = c.status(c.prefill[0])
            groups = {q.tenant: q.tokens for q in s.queued_prompts}
            return groups.get("flood", 0) >= 3 * FLOOD_TOKENS or f.errors
        wait_for(flood_queued, 60, "the flood queued on the prefill worker, by tenant")
        # chat: its 600 and the flood's 600 (1,200 tokens); the flood's tenant: all of the
        # flood ahead (8,000 tokens, less what drains before the request) and its 600; the
        # bound between them (the second router has learnt no rest yet: its first requests),
        # read at the rate the worker reports under the flood, which the router predicts by:
        # that rate is lower than before the flood (its chunks attend to longer contexts, and
        # on a loaded 2-core machine far lower: a bound read before the flood refused chat at
        # 27% of that rate). At 2,100 tokens' time the chat fits down to 57% of the rate read
        # here, and the flood's request stays over while 1,500 of its tokens are left.
        rate = c.status(c.prefill[0]).prefill_tokens_per_second
        bound_ms = int(1000 * 2100 / rate)
        slo = slo_router(bin_dir, model_path, c, bound_ms)
        stub = slo_stub(slo, pb)
        time.sleep(0.15)  # the second router's next poll
        # refused, not prefilled on the decode worker instead (the test below): that worker
        # has computed no prompt (only the KV of remote prefills came to it, and a handful
        # of decode steps fit no step model), so it reports no prefill rate to predict by
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request(own, 50, "flood"), timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert "the workers are busy" in e.value.details()
        flood_predicted = float(e.value.details().split("first token is ")[1].split(" s")[0])
        try:
            last = list(stub.Generate(request(own, 51, "chat"), timeout=120))[-1]
        except grpc.RpcError as err:  # say at what rate the worker's queue was read
            pytest.fail(f"chat refused: {err.details()}; the prefill worker reports "
                        f"{c.status(c.prefill[0]).prefill_tokens_per_second:.0f} tokens/s, "
                        f"{rate:.0f} when the bound was set")
        assert last.finish_reason, last
        chat_predicted = last.usage.predicted_ttft_seconds
        assert 0 < chat_predicted < bound_ms / 1000, (last.usage, bound_ms)
        assert flood_predicted > 1.5 * chat_predicted, (flood_predicted, chat_predicted)
        assert metric(slo.metrics(), "chunkserve:requests_refused_ttft_total") == 1
        f.join()
        assert not f.errors, f.errors
    finally:
        rc = slo.stop() if slo is not None else 0
        c.stop()
    assert rc == 0, slo.stderr()[-3000:]


def test_the_router_prefills_on_a_decode_worker_to_keep_the_bound(bin_dir, model_path, pb):
    """A long prompt goes to the prefill pool while that pool is predicted to meet its TTFT
    bound. When a flood puts the prefill pool over the bound and a decode worker's own prefill
    is predicted within it, the router prefills the prompt there instead of refusing it
    (chunkserve:prefills_slo_local_total), as disaggregated servers do when their prefill queue
    is too long; only when neither meets the bound is a request refused (the tests above, where
    the decode worker has computed no prompt and so reports no rate)."""
    c = Cluster(bin_dir, model_path, pb, n_prefill=1, n_decode=1,
                prefill_args=["--max-batched-tokens=64"])
    slo = None
    try:
        g = pb.generation_pb2

        def request(n, seed):
            return g.GenerateRequest(token_ids=g.TokenIds(ids=[(seed * 7 + k) % 300 + 3 for k in range(n)]),
                                     sampling=g.SamplingParams(max_tokens=2, ignore_eos=True))

        for i, n in enumerate((520, 700, 900)):  # remote prefills: the prefill worker's rate
            list(c.stub.Generate(request(n, i), timeout=120))
        for i, n in enumerate((300, 400, 450, 350)):  # local prefills: the decode worker's
            list(c.stub.Generate(request(n, 10 + i), timeout=120))
        rate = wait_for(lambda: c.status(c.prefill[0]).prefill_tokens_per_second, 30,
                        "the prefill worker reports its rate")
        local_rate = wait_for(lambda: c.status(c.decode[0]).prefill_tokens_per_second, 30,
                              "the decode worker reports its rate")
        own = 600
        # Behind the flood (3,000 tokens or more queued when it is seen) and its own 600, the
        # request is over a bound of 2,100 tokens' time on the prefill worker (as in the tenant
        # test above) even at 171% of the rate read now (less what drains before it is
        # predicted); on the idle decode worker its 600
        # tokens fit in it down to 29% of the prefill worker's rate (it takes larger chunks
        # than the prefill worker's 64 and reads at least as fast).
        bound_ms = int(1000 * 2100 / rate)
        assert own / local_rate < 0.8 * bound_ms / 1000, (rate, local_rate)
        slo = slo_router(bin_dir, model_path, c, bound_ms)
        stub = slo_stub(slo, pb)
        f = Flood(c.stub, g, FLOOD, FLOOD_TOKENS, seed=30)
        wait_for(lambda: c.status(c.prefill[0]).queued_prefill_tokens >= 3 * FLOOD_TOKENS
                 or f.errors, 60, "the flood queued on the prefill worker")
        time.sleep(0.15)  # the second router's next poll
        try:
            last = list(stub.Generate(request(own, 60), timeout=120))[-1]
        except grpc.RpcError as err:
            pytest.fail(f"refused: {err.details()}; the workers report prefill rates of "
                        f"{c.status(c.prefill[0]).prefill_tokens_per_second:.0f} (prefill) and "
                        f"{c.status(c.decode[0]).prefill_tokens_per_second:.0f} (decode) "
                        f"tokens/s, {rate:.0f} and {local_rate:.0f} when the bound was set")
        assert last.finish_reason, last
        assert 0 < last.usage.predicted_ttft_seconds < bound_ms / 1000, (last.usage, bound_ms)
        m = slo.metrics()
        assert metric(m, "chunkserve:prefills_slo_local_total") == 1
        assert metric(m, "chunkserve:prefills_total", 'path="local"') == 1
        assert metric(m, "chunkserve:prefills_total", 'path="remote"') == 0
        assert metric(m, "chunkserve:requests_refused_ttft_total") == 0
        f.join()
        assert not f.errors, f.errors
        # with the flood gone the prefill pool meets the bound again: remote, as before
        c.wait_idle()
        time.sleep(0.3)
        list(stub.Generate(request(own, 61), timeout=120))
        m = slo.metrics()
        assert metric(m, "chunkserve:prefills_total", 'path="remote"') == 1
        assert metric(m, "chunkserve:prefills_slo_local_total") == 1
    finally:
        rc = slo.stop() if slo is not None else 0
        c.stop()
    assert rc == 0, slo.stderr()[-3000:]
