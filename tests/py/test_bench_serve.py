"""`chunkserve bench serve`: its arrival processes against their distributions, its
percentiles against numpy's on the samples it measured, a complete report from a real
`chunkserve serve` (tiny model), and bad arguments refused with a clear message.

The statistical checks use fixed seeds, so they are deterministic; each also shows it can
fail (the same statistic against a wrong distribution is far over its bound).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from test_serve import Server, pb, tiny_model  # noqa: F401  (fixtures)

pytestmark = pytest.mark.tiny


def clean(r):
    """Under the ASan build (make test-serve-asan): no report from the client either."""
    assert "Sanitizer" not in r.stderr and "runtime error:" not in r.stderr, r.stderr[-6000:]
    return r


def bench(exe: Path, *args, timeout=120):
    return clean(subprocess.run([str(exe), "bench", "serve", *[str(a) for a in args]],
                                capture_output=True, text=True, timeout=timeout))


def dry(exe: Path, *args):
    r = bench(exe, "--dry-run", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def gaps(sched):
    return np.diff(np.asarray(sched["offset_s"]))


def ks_one_sample(x, cdf):
    """Kolmogorov-Smirnov statistic of samples x against a CDF."""
    x = np.sort(x)
    n = len(x)
    f = cdf(x)
    return max(np.max(np.arange(1, n + 1) / n - f), np.max(f - np.arange(0, n) / n))


def ks_two_sample(a, b):
    a, b = np.sort(a), np.sort(b)
    allv = np.concatenate([a, b])
    fa = np.searchsorted(a, allv, side="right") / len(a)
    fb = np.searchsorted(b, allv, side="right") / len(b)
    return np.max(np.abs(fa - fb))


N = 10_001  # 10,000 gaps


def test_poisson_gaps_are_exponential(chunkserve_bin):
    rate = 5.0
    g = gaps(dry(chunkserve_bin, "--arrival", "poisson", "--rates", rate, "--requests", N,
                 "--seed", 11))
    assert len(g) == N - 1 and g.min() > 0
    crit = 1.36 / math.sqrt(len(g))  # alpha = 0.05
    d = ks_one_sample(g, lambda x: 1 - np.exp(-rate * x))
    assert d < crit, (d, crit)
    assert abs(g.mean() * rate - 1) < 0.05
    # The check can fail: bursty gamma gaps of the same mean are far from exponential.
    bursty = gaps(dry(chunkserve_bin, "--arrival", "gamma", "--burstiness", 0.3, "--rates", rate,
                      "--requests", N, "--seed", 11))
    assert ks_one_sample(bursty, lambda x: 1 - np.exp(-rate * x)) > 5 * crit


@pytest.mark.parametrize("shape", [0.25, 1.0, 4.0])
def test_gamma_gaps_match_numpy_gamma(chunkserve_bin, shape):
    rate = 2.0
    g = gaps(dry(chunkserve_bin, "--arrival", "gamma", "--burstiness", shape, "--rates", rate,
                 "--requests", N, "--seed", 5))
    ref = np.random.default_rng(5).gamma(shape, 1 / (rate * shape), size=len(g))
    crit = 1.36 * math.sqrt(2 / len(g))
    assert ks_two_sample(g, ref) < crit
    assert abs(g.mean() * rate - 1) < 0.06
    assert abs(g.std() / g.mean() * math.sqrt(shape) - 1) < 0.08  # CV = 1/sqrt(shape)
    wrong = np.random.default_rng(5).gamma(shape * 2, 1 / (rate * shape * 2), size=len(g))
    assert ks_two_sample(g, wrong) > 2 * crit


def test_fixed_and_infinite_rates(chunkserve_bin):
    g = gaps(dry(chunkserve_bin, "--arrival", "fixed", "--rates", 4, "--requests", 1000))
    assert np.allclose(g, 0.25, rtol=0, atol=1e-9)
    s = dry(chunkserve_bin, "--rates", "inf", "--requests", 50)
    assert s["rate"] == "inf" and max(s["offset_s"]) == 0


def test_workload_mix_lengths_and_determinism(chunkserve_bin):
    s = dry(chunkserve_bin, "--workload", "mixed", "--requests", N, "--seed", 3, "--rates", 1)
    assert s["classes"] == ["chat", "rag", "summarize"]
    cls = np.asarray(s["class"])
    p, o = np.asarray(s["prompt_tokens"]), np.asarray(s["output_tokens"])
    for k, (frac, plo, phi, olo, ohi) in enumerate([(0.70, 32, 512, 64, 256),
                                                   (0.15, 3000, 8000, 16, 64),
                                                   (0.15, 1000, 4000, 128, 384)]):
        sel = cls == k
        sigma = math.sqrt(frac * (1 - frac) / N)
        assert abs(sel.mean() - frac) < 4 * sigma, (k, sel.mean())
        assert p[sel].min() >= plo and p[sel].max() <= phi
        assert o[sel].min() >= olo and o[sel].max() <= ohi
        # uniform: the mean in the middle, both ends reached
        assert abs(p[sel].mean() - (plo + phi) / 2) < 0.05 * (phi - plo)
        assert p[sel].min() < plo + 0.02 * (phi - plo) and p[sel].max() > phi - 0.02 * (phi - plo)
    # the same seed gives the same schedule; the rate moves only the offsets
    again = dry(chunkserve_bin, "--workload", "mixed", "--requests", N, "--seed", 3, "--rates", 1)
    assert again == s
    faster = dry(chunkserve_bin, "--workload", "mixed", "--requests", N, "--seed", 3, "--rates", 7)
    assert faster["prompt_tokens"] == s["prompt_tokens"]
    assert faster["offset_s"] != s["offset_s"]
    other = dry(chunkserve_bin, "--workload", "mixed", "--requests", N, "--seed", 4, "--rates", 1)
    assert other["prompt_tokens"] != s["prompt_tokens"]
    # shared-prefix groups: every group used, the prefix added to the prompt
    g = dry(chunkserve_bin, "--workload", "chat", "--requests", 400, "--prefix-groups", 4,
            "--prefix-tokens", 1000)
    assert sorted(set(g["group"])) == [0, 1, 2, 3]
    assert min(g["prompt_tokens"]) >= 1032


@pytest.fixture(scope="module")
def server(chunkserve_bin, tiny_model, pb):  # noqa: F811
    s = Server(chunkserve_bin, tiny_model, pb, "--kv-cache-mib", "8", "--max-batched-tokens", "256",
               "--threads", "1")
    yield s
    s.stop()


SUMMARY = {"n", "mean", "p50", "p90", "p99", "max"}
POINT = {"requests", "completed", "failed", "errors", "error_messages", "duration_s",
         "request_throughput", "output_tokens", "prompt_tokens", "cached_prompt_tokens",
         "output_tok_s", "total_tok_s", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "itl_cdf_ms",
         "slo_met", "good_requests", "good_request_rate", "per_request"}


def check_summary(summary, samples, rel=1e-9):
    """The report's percentiles equal numpy's on the samples it saved."""
    samples = np.asarray(samples, dtype=float)
    assert summary["n"] == len(samples)
    if len(samples) == 0:
        return
    for key, q in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100)):
        assert math.isclose(summary[key], np.percentile(samples, q), rel_tol=rel, abs_tol=1e-9), \
            (key, summary[key], np.percentile(samples, q))
    assert math.isclose(summary["mean"], samples.mean(), rel_tol=rel)


def test_report_against_a_real_server(chunkserve_bin, server, tmp_path):
    out = tmp_path / "report.json"
    r = bench(chunkserve_bin, "--target", server.addr, "--workload", "chat", "--rates", "20,inf",
              "--requests", 12, "--seed", 3, "--save-requests", "--out", out,
              "--slo-ttft-p99-ms", 60000, "--slo-itl-p99-ms", 60000)
    assert r.returncode == 0, r.stderr
    assert "point 1 done: 12/12 ok" in r.stderr  # progress and summaries on stderr
    rep = json.loads(out.read_text())
    assert rep["model"]["name"] == "chunkserve tiny test model"
    assert rep["model"]["context_length"] == 4096
    assert {"workload", "arrival", "seed", "slo_ttft_p99_ms", "slo_itl_p99_ms"} <= set(rep["config"])
    assert [p["rate"] for p in rep["points"]] == [20, "inf"]
    for p in rep["points"]:
        assert POINT <= set(p), POINT - set(p)
        assert p["completed"] == 12 and p["failed"] == 0 and p["errors"] == {}
        reqs = p["per_request"]
        assert len(reqs) == 12 and all(q["status"] == "OK" for q in reqs)
        # ignore_eos: every stream as long as asked, every token accounted for
        assert all(q["output_tokens"] == q["max_tokens"] for q in reqs)
        # one ITL sample between two token messages (a message may carry several tokens)
        assert all(len(q["itl_ms"]) == q["messages"] - 1 for q in reqs)
        assert all(1 <= q["messages"] <= q["output_tokens"] for q in reqs)
        assert p["output_tokens"] == sum(q["output_tokens"] for q in reqs)
        assert p["prompt_tokens"] == sum(q["prompt_tokens"] for q in reqs) > 0
        check_summary(p["ttft_ms"], [q["ttft_ms"] for q in reqs])
        check_summary(p["e2e_ms"], [q["e2e_ms"] for q in reqs])
        itl = [x for q in reqs for x in q["itl_ms"]]
        check_summary(p["itl_ms"], itl)
        check_summary(p["tpot_ms"], [(q["e2e_ms"] - q["ttft_ms"]) / (q["output_tokens"] - 1)
                                     for q in reqs], rel=1e-6)
        cdf = p["itl_cdf_ms"]
        assert len(cdf) == (101 if itl else 0) and cdf == sorted(cdf)
        if itl:
            assert math.isclose(cdf[99], np.percentile(itl, 99), rel_tol=1e-9)
        assert math.isclose(p["output_tok_s"], p["output_tokens"] / p["duration_s"], rel_tol=1e-9)
        assert p["slo_met"] and p["good_requests"] == 12
    # open loop at 20/s: requests were sent on their schedule, not all at once
    sent = [q["sent_s"] for q in rep["points"][0]["per_request"]]
    offs = [q["offset_s"] for q in rep["points"][0]["per_request"]]
    assert max(offs) > 0.1 and all(s >= o - 1e-3 for s, o in zip(sent, offs))
    assert rep["goodput"]["rate"] == "inf" and rep["goodput"]["request_throughput"] > 0
    assert rep["client_cpu_s"] >= 0


def test_slo_missed_and_closed_loop(chunkserve_bin, server):
    # an SLO no server meets: no goodput; closed loop sweeps concurrency
    r = bench(chunkserve_bin, "--target", server.addr, "--arrival", "closed", "--concurrency",
              "1,3", "--requests", 6, "--slo-ttft-p99-ms", 0.001, "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    rep = json.loads(r.stdout)
    assert [p["concurrency"] for p in rep["points"]] == [1, 3]
    assert all(p["completed"] == 6 and not p["slo_met"] for p in rep["points"])
    assert rep["goodput"]["concurrency"] is None


def test_shared_prefix_groups_hit_the_cache(chunkserve_bin, server):
    r = bench(chunkserve_bin, "--target", server.addr, "--workload", "chat", "--requests", 8,
              "--prefix-groups", 2, "--prefix-tokens", 256, "--arrival", "closed", "--quiet")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["points"][0]
    assert p["completed"] == 8
    # 2 groups x 256 shared tokens: every request after its group's first reuses 16 pages
    assert p["cached_prompt_tokens"] >= 6 * 256


def test_dataset_file(chunkserve_bin, server, tmp_path):
    ds = tmp_path / "set.jsonl"
    ds.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "hello there, how are you", "output_tokens": 5},
        {"token_ids": [300, 301, 302, 303, 304, 305, 306], "max_tokens": 3},
        {"prompt_tokens": 40, "output_tokens": 4, "group": 1},
    ]) + "\n")
    r = bench(chunkserve_bin, "--target", server.addr, "--workload", ds, "--requests", 9,
              "--save-requests", "--quiet", "--prefix-tokens", 16, "--arrival", "closed")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["config"]["workload"] == "set.jsonl"
    reqs = rep["points"][0]["per_request"]
    by_max = {q["max_tokens"]: q for q in reqs}
    assert set(by_max) <= {5, 3, 4} and len(by_max) >= 2
    if 3 in by_max:
        assert by_max[3]["prompt_tokens"] == 7
    if 4 in by_max:
        assert by_max[4]["prompt_tokens"] == 40
    assert all(q["status"] == "OK" and q["output_tokens"] == q["max_tokens"] for q in reqs)


def test_openai_http_target(chunkserve_bin, tiny_model, tmp_path):  # noqa: F811
    """The same measurement through the OpenAI-compatible API (http://): streamed
    /v1/completions, every stream as long as asked (usage), percentiles = numpy's."""
    err = open(tmp_path / "serve.err", "w")
    p = subprocess.Popen([str(chunkserve_bin), "serve", "--model", str(tiny_model), "--port", "0",
                          "--openai-port", "0", "--threads", "1", "--kv-cache-mib", "8"],
                         stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        addr = None
        for _ in range(3):
            line = p.stdout.readline()
            if line.startswith("openai listening on "):
                addr = line.split()[-1]
        assert addr, "no openai port"
        r = bench(chunkserve_bin, "--target", f"http://{addr}", "--requests", 8, "--rates", "30,inf",
                  "--save-requests", "--quiet", "--prefix-groups", 2, "--prefix-tokens", 64)
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["model"] == {"name": "chunkserve tiny test model", "context_length": 4096,
                                "vocab_size": 349}
        for pt in rep["points"]:
            reqs = pt["per_request"]
            assert pt["completed"] == 8 and pt["errors"] == {}
            assert all(q["output_tokens"] == q["max_tokens"] and q["prompt_tokens"] > 64
                       for q in reqs)
            assert all(len(q["itl_ms"]) == q["messages"] - 1 for q in reqs)
            check_summary(pt["ttft_ms"], [q["ttft_ms"] for q in reqs])
            check_summary(pt["itl_ms"], [x for q in reqs for x in q["itl_ms"]])
            assert pt["cached_prompt_tokens"] > 0  # the groups' shared heads
        # an HTTP error is counted under its status's gRPC name, with the server's message
        r = bench(chunkserve_bin, "--target", f"http://{addr}", "--requests", 2, "--quiet",
                  "--served-model-name", "chunkserve tiny test model", "--temperature", 99)
        assert r.returncode == 0, r.stderr
        pt = json.loads(r.stdout)["points"][0]
        assert pt["errors"] == {"INVALID_ARGUMENT": 2} and "temperature" in \
            pt["error_messages"]["INVALID_ARGUMENT"]
        bad = bench(chunkserve_bin, "--target", "http://127.0.0.1:1", "--connect-timeout-ms", 500)
        assert bad.returncode == 1 and "GET /v1/models" in bad.stderr
        bad = bench(chunkserve_bin, "--target", "http://nohost", "--dry-run")
        assert bad.returncode == 0  # a dry run needs no target
    finally:
        p.terminate()
        p.wait(timeout=30)
        err.close()


def test_tenants_draw_by_weight_and_their_workloads(chunkserve_bin):
    s = dry(chunkserve_bin, "--tenants", "a=1:rag:3,b=3", "--requests", 2000, "--seed", 5)
    assert s["tenants"] == ["a", "b"]
    t = np.asarray(s["tenant"])
    assert abs((t == 0).mean() - 0.25) < 0.03  # drawn by weight
    pl, pr = np.asarray(s["prompt_tokens"]), np.asarray(s["priority"])
    assert pl[t == 0].min() >= 3000 and pl[t == 0].max() <= 8000  # a's lengths: rag's
    assert pl[t == 1].max() <= 512  # b's: the run's workload (chat)
    assert set(pr[t == 0]) == {3} and set(pr[t == 1]) == {0}
    # tenants that name no workload leave the run's lengths alone
    plain = dry(chunkserve_bin, "--requests", 50, "--seed", 5)
    mixed = dry(chunkserve_bin, "--requests", 50, "--seed", 5, "--tenants", "x=1,y=1")
    assert plain["prompt_tokens"] == mixed["prompt_tokens"]


def test_tenants_and_priorities_in_the_report(chunkserve_bin, server):
    # steps of several sizes first, so that the server's step model is fitted (it predicts
    # TTFTs from then on), whatever ran before on it
    warm = bench(chunkserve_bin, "--target", server.addr, "--workload", "chat", "--requests", 8,
                 "--arrival", "closed", "--concurrency", 2, "--quiet", "--seed", 9)
    assert warm.returncode == 0, warm.stderr
    r = bench(chunkserve_bin, "--target", server.addr, "--workload", "chat", "--requests", 16,
              "--tenants", "a=1::0,b=3::5", "--arrival", "closed", "--concurrency", 4,
              "--save-requests", "--quiet", "--seed", 2)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["points"][0]
    reqs = p["per_request"]
    assert p["completed"] == 16
    assert set(p["tenants"]) == {q["tenant"] for q in reqs} == {"a", "b"}
    served = []
    for name, t in p["tenants"].items():
        mine = [q for q in reqs if q["tenant"] == name]
        assert t["requests"] == t["completed"] == len(mine)
        assert t["prompt_tokens"] == sum(q["prompt_tokens"] for q in mine)
        assert t["output_tokens"] == sum(q["output_tokens"] for q in mine)
        check_summary(t["ttft_ms"], [q["ttft_ms"] for q in mine])
        served.append(t["prompt_tokens"] + t["output_tokens"])
    x = np.asarray(served, dtype=float)
    assert math.isclose(p["jain_index"], x.sum() ** 2 / (len(x) * (x ** 2).sum()), rel_tol=1e-9)
    assert set(p["priorities"]) == {"0", "5"}
    assert all(q["priority"] == (0 if q["tenant"] == "a" else 5) for q in reqs)
    assert p["priorities"]["5"]["requests"] == p["tenants"]["b"]["requests"]
    # the server predicts each request's TTFT once its step model is fitted (the warm-up):
    # the report compares the predictions with the TTFTs measured here
    e = p["ttft_prediction_error"]
    assert 1 <= e["n"] <= 16 and e["p50"] >= 0 and 0 <= e["within_20pct"] <= 1
    assert e["n"] == sum(1 for q in reqs if "predicted_ttft_ms" in q)


def test_the_tenant_is_sent(chunkserve_bin, tiny_model, pb, tmp_path):  # noqa: F811
    """A server whose API key belongs to tenant a: the bench's tenant a is served, tenant b is
    refused by name (so the field reaches it)."""
    keys = tmp_path / "keys"
    keys.write_text("bench-key-0123 a\n")
    s = Server(chunkserve_bin, tiny_model, pb, "--kv-cache-mib", "8", "--threads", "1",
               "--api-key-file", str(keys))
    try:
        ok = bench(chunkserve_bin, "--target", s.addr, "--requests", 3, "--quiet", "--api-key",
                   "bench-key-0123", "--tenants", "a=1", "--warmup", 0)
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["points"][0]["completed"] == 3
        bad = bench(chunkserve_bin, "--target", s.addr, "--requests", 3, "--quiet", "--api-key",
                    "bench-key-0123", "--tenants", "b=1", "--warmup", 0)
        assert bad.returncode == 0, bad.stderr
        pt = json.loads(bad.stdout)["points"][0]
        assert pt["errors"] == {"PERMISSION_DENIED": 3}
        assert "tenant 'b' is not the API key's (a)" in pt["error_messages"]["PERMISSION_DENIED"]
    finally:
        s.stop()


@pytest.mark.parametrize("args,words", [
    ([], "--target HOST:PORT is required"),
    (["--dry-run", "--rates", "0"], "--rates '0'"),
    (["--dry-run", "--rates", "1,x"], "rates > 0"),
    (["--dry-run", "--arrival", "bursty"], "one of poisson, gamma, fixed, closed"),
    (["--dry-run", "--arrival", "closed", "--concurrency", "1.5"], "whole numbers"),
    (["--dry-run", "--workload", "chats"], "one of chat, rag, summarize, mixed"),
    (["--dry-run", "--workload", "/nonexistent/x.jsonl"], "/nonexistent/x.jsonl"),
    (["--dry-run", "--burstiness", "0.5"], "--arrival gamma only"),
    (["--dry-run", "--prefix-groups", "3"], "go together"),
    (["--dry-run", "--requests", "0"], "requests"),
    (["--dry-run", "--frobnicate"], "frobnicate"),
    (["--dry-run", "--tenants", "a"], "not NAME=WEIGHT"),
    (["--dry-run", "--tenants", "a=0"], "the weight must be in (0, 1e6]"),
    (["--dry-run", "--tenants", "a=1,a=2"], "named twice"),
    (["--dry-run", "--tenants", "a=1:chats"], "chat, rag or summarize"),
    (["--dry-run", "--tenants", "a=1:chat:-1"], "the priority must be an integer"),
    (["--dry-run", "--tenants", "a b=1"], "not NAME=WEIGHT"),
])
def test_bad_arguments(chunkserve_bin, args, words):
    r = bench(chunkserve_bin, *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert words in r.stderr and r.stdout == ""


def test_bad_dataset_lines(chunkserve_bin, tmp_path):
    for line, words in [("{\"prompt\": \"x\"}", "\"output_tokens\" (or \"max_tokens\") is required"),
                        ("[1, 2]", "not a JSON object"),
                        ("{\"prompt_tokens\": -4, \"output_tokens\": 2}", "\"prompt_tokens\""),
                        ("{\"token_ids\": [1, -2], \"output_tokens\": 2}", "token_ids[1]"),
                        ("{\"prompt\": \"a\", \"prompt_tokens\": 3, \"output_tokens\": 2}",
                         "one of")]:
        ds = tmp_path / "bad.jsonl"
        ds.write_text("{\"prompt\": \"ok\", \"output_tokens\": 1}\n" + line + "\n")
        r = bench(chunkserve_bin, "--dry-run", "--workload", ds)
        assert r.returncode == 2 and f"bad.jsonl:2: " in r.stderr and words in r.stderr, r.stderr


def test_unreachable_target(chunkserve_bin):
    r = bench(chunkserve_bin, "--target", "127.0.0.1:1", "--connect-timeout-ms", 1500, timeout=30)
    assert r.returncode == 1
    assert "target 127.0.0.1:1: ListModels:" in r.stderr, r.stderr


# ------------------------------------------------------------------ tune --

def tune(exe: Path, *args, timeout=300):
    # CHUNKSERVE_MODEL (make test sets it for the servers) would stand in for a missing --model
    env = {k: v for k, v in os.environ.items() if k != "CHUNKSERVE_MODEL"}
    return clean(subprocess.run([str(exe), "tune", *[str(a) for a in args]],
                                capture_output=True, text=True, timeout=timeout, env=env))


def test_tune_recommends_the_best_measured_configuration(chunkserve_bin, tiny_model, tmp_path):  # noqa: F811
    out = tmp_path / "tune.json"
    r = tune(chunkserve_bin, "--model", tiny_model, "--workload", "chat", "--budgets", "0,64",
             "--step-targets", "20", "--ratios", "1:1", "--prefill-budgets", "256", "--cores", 2,
             "--rates", "10,inf", "--requests", 8, "--seconds-per-point", 30,
             "--slo-ttft-p99-ms", 10000, "--slo-itl-p99-ms", 1000, "--kv-cache-mib", 16,
             "--log-dir", tmp_path / "logs", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    # it says how long it can take before it starts anything
    assert "4 configurations on 2 cores" in r.stderr and "at most" in r.stderr
    res = json.loads(out.read_text())
    configs = res["configurations"]
    assert [c["name"] for c in configs] == ["serve unchunked", "serve budget 64",
                                           "serve step target 20 ms",
                                           "cluster P1:D1 prefill budget 256"]
    assert all("error" not in c for c in configs), configs
    assert all(c["points"] >= 1 and c["request_throughput"] > 0 for c in configs)

    def key(c):  # the highest goodput rate, then the most headroom under the SLO there
        g = c["goodput_rate"]
        return (-1 if g is None else math.inf if g == "inf" else g, -c["slo_use"])

    assert all(math.isclose(c["slo_use"], max(c["ttft_p99_ms"] / 10000, c["itl_p99_ms"] / 1000),
                            rel_tol=1e-9) for c in configs if c["goodput_rate"] is not None)
    best = max(configs, key=key)  # max keeps the first of equals: the earlier candidate
    assert res["recommended"] == best["name"]
    assert f"{best['name']}: the SLO held up to" in r.stdout
    assert "prefill.autoscaling.prefillTokensPerSecond" in r.stdout
    # every configuration's own bench report and process log are kept
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert [f"config-{i:02d}.json" for i in range(4)] == [x for x in logs if x.endswith(".json")]


@pytest.mark.parametrize("args,words", [
    (["--workload", "chat"], "--model is required"),
    (["--model", "/nonexistent.gguf"], "/nonexistent.gguf"),
    (["--slo-ttft-p99-ms", 0, "--slo-itl-p99-ms", 0], "an SLO needs"),
    (["--ratios", "2:0"], "P:D pairs"),
    (["--ratios", "4:4", "--cores", 2], "needs 8 cores"),
    (["--budgets", "64,-1"], "--budgets"),
    (["--step-targets", "0"], "must be > 0"),
    (["--budgets", "none", "--step-targets", "none", "--ratios", "none"], "no configurations"),
    (["--rates", "1,x"], "--rates"),
    (["--workload", "nope"], "--workload 'nope'"),
])
def test_tune_bad_arguments(chunkserve_bin, tiny_model, args, words):  # noqa: F811
    if "--model" not in args and words != "--model is required":
        args = ["--model", tiny_model, *args]
    r = tune(chunkserve_bin, "--dry-run", *args, timeout=30)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert words in r.stderr, r.stderr


def test_tune_dry_run_plans_without_starting(chunkserve_bin, tiny_model):  # noqa: F811
    r = tune(chunkserve_bin, "--model", tiny_model, "--dry-run", "--cores", 3,
             "--slo-itl-p99-ms", 100, timeout=30)
    assert r.returncode == 0, r.stderr
    # 6 budgets, 2 step targets (0.5 and 0.8 x the ITL SLO), P:D 1:1, 1:2, 2:1 x 2 prefill budgets
    assert "14 configurations on 3 cores" in r.stderr
    assert "serve step target 50 ms" in r.stderr and "serve step target 80 ms" in r.stderr
    assert "cluster P2:D1 prefill budget 8192" in r.stderr
    assert r.stdout == ""
