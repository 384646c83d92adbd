"""Migration is exact at every cut (issue 18): the router's fault injection
(--fault-migrate-every=K) drops a stream's worker calls after every K-th message, as if
its decode worker had died there, and the stream migrates (prompt + the tokens relayed so
far, the latest RNG state; remote prefill when that context is long).  With K=1 a stream
of N messages is cut at every message index; K=2 and 3 shift the cuts.  Each stream must
equal the uninterrupted single-process run (`chunkserve serve`) in tokens, text, finish
reason, logprobs and usage: sampled with penalties, stop strings of 1 to 256 bytes taken
from the reference text so that they span cuts, and emoji split across tokens.

The real model (its byte-level BPE splits emoji into several tokens); 1 prefill + 2
decode workers behind the router, the first speculating with prompt lookup (`--speculative
ngram`), the second with a draft model (`--speculative draft:PATH`, the model itself: the
only one with its vocabulary here; `--speculative-always`, since a draft as costly as its
target never pays by the cost rule): streams move between the two, so every check also holds
with either kind of speculation on either side of a cut. No speculation state moves: prompt
lookup looks its drafts up again from the tokens, and the draft model's KV is rebuilt on
the new worker (computed in the steps' room before it drafts again)."""
from __future__ import annotations

import json

import pytest

grpc = pytest.importorskip("grpc")

from cluster_harness import Cluster, Reference, metric  # noqa: E402

pytestmark = pytest.mark.cluster

EMOJI = "Emoji list: 🐙 octopus, 🦑 squid, 🐠 fish, 🐟 fish, 🌍 earth, 🔥 fire, 💧"
PROSE = ("The lighthouse keeper kept a logbook of every ship that passed, the weather, "
         "and the colour of the sea at dawn. One winter morning she wrote:")
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=1234, repetition_penalty=1.1,
               presence_penalty=0.3, frequency_penalty=0.2)


@pytest.fixture(scope="module")
def pb(proto_modules):
    return type("PB", (), proto_modules)


@pytest.fixture(scope="module")
def ref(bin_dir, model_path, pb):
    r = Reference(bin_dir / "chunkserve", model_path, pb)
    yield r
    r.stop()


def router_for(cl, every):
    """A router of the cluster's workers that migrates after every `every`-th message."""
    from cluster_harness import Proc
    rargs = [f"--model={cl.model}", "--port=0", "--status-interval-ms=100", "--grace-ms=3000",
             "--decode-workers=" + ",".join(p.addr for p in cl.decode),
             "--prefill-workers=" + ",".join(p.addr for p in cl.prefill),
             "--local-prefill-threshold=40", f"--fault-migrate-every={every}",
             "--max-retries=0"]  # no real failure is expected: any would end the stream
    return Proc(cl.router.exe, rargs, f"router-every-{every}")


@pytest.fixture(scope="module")
def cl(bin_dir, model_path, pb):
    for b in ("chunkserve-router", "chunkserve-prefill", "chunkserve-decode", "chunkserve"):
        if not (bin_dir / b).is_file():
            pytest.skip(f"{b} not built")
    c = Cluster(bin_dir, model_path, pb, n_prefill=1, n_decode=2, threads=1, kv_cache_mib=128,
                decode_each=[["--speculative=ngram", "--num-speculative-tokens=6"],
                             [f"--speculative=draft:{model_path}", "--num-speculative-tokens=4",
                              "--speculative-always"]])
    c.model = model_path
    c.wait_usable(1, 2)
    routers = {}
    for every in (1, 2, 3):
        r = router_for(c, every)
        r.channel = grpc.insecure_channel(r.addr)
        r.stub = pb.generation_pb2_grpc.GenerationStub(r.channel)
        routers[every] = r
    c.routers = routers
    yield c
    for r in routers.values():
        r.channel.close()
        assert r.stop() == 0, r.stderr()[-3000:]
    c.stop()


def stream(stub, g, prompt, n, **sampling):
    msgs = list(stub.Generate(g.GenerateRequest(
        prompt=prompt, sampling=g.SamplingParams(max_tokens=n, **sampling)), timeout=300))
    return msgs


def summary(msgs):
    """What a client sees, independent of how the stream was cut into messages."""
    ids = [t for m in msgs for t in m.token_ids]
    text = "".join(m.text for m in msgs)
    lps = [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs])
           for m in msgs for lp in m.logprobs]
    last = msgs[-1]
    return ids, text, last.finish_reason, (last.usage.prompt_tokens,
                                           last.usage.completion_tokens), lps


def same_logprobs(a, b):
    """The same ids; values equal to 1e-3 (a migrated position's logits come from a
    prefill, the reference's from a decode step: equal to ~1e-5, not bitwise)."""
    if len(a) != len(b):
        return False
    for (ia, la, ta), (ib, lb, tb) in zip(a, b):
        if ia != ib or abs(la - lb) > 1e-3 or [t for t, _ in ta] != [t for t, _ in tb]:
            return False
        if any(abs(x - y) > 1e-3 for (_, x), (_, y) in zip(ta, tb)):
            return False
    return True


def wait_for_usable(r, n_decode):
    from cluster_harness import wait_for
    wait_for(lambda: metric(r.metrics(), "chunkserve:workers_usable", 'role="decode"') == n_decode
             and metric(r.metrics(), "chunkserve:workers_usable", 'role="prefill"') == 1,
             30, f"{r.name} to see its workers")


def check(cl, pb, every, prompt, n, min_cuts, **sampling):
    g = pb.generation_pb2
    r = cl.routers[every]
    wait_for_usable(r, len(cl.decode))
    want = summary(stream(cl.ref.stub, g, prompt, n, **sampling))
    before = metric(r.metrics(), "chunkserve:migrations_total")
    got_msgs = stream(r.stub, g, prompt, n, **sampling)
    got = summary(got_msgs)
    cuts = metric(r.metrics(), "chunkserve:migrations_total") - before
    assert got[0] == want[0], f"tokens differ (every={every}, {cuts:.0f} cuts)"
    assert got[1] == want[1], f"text differs (every={every}, {cuts:.0f} cuts)"
    assert got[2:4] == want[2:4], f"finish or usage differ (every={every})"
    assert same_logprobs(got[4], want[4]), f"logprobs differ (every={every})"
    # a cut after every K-th message with tokens but the last (messages may carry several)
    assert cuts == sum(1 for m in got_msgs[:-1] if m.token_ids) // every, cuts
    assert cuts >= min_cuts, (cuts, min_cuts)
    return want


@pytest.fixture(scope="module", autouse=True)
def attach_ref(cl, ref):
    cl.ref = ref


@pytest.mark.parametrize("every", [1, 2, 3])
def test_sampled_with_penalties_and_logprobs(cl, pb, every):
    n = 48
    want = check(cl, pb, every, PROSE, n, min_cuts=n // (4 * every), ignore_eos=True,
                 logprobs=True, top_logprobs=3, **SAMPLED)
    assert len(want[0]) == n and len(want[4]) == n


def test_emoji_split_across_tokens(cl, pb, ref):
    """The reference output holds 4-byte characters whose bytes are spread over several
    tokens, so cuts fall inside characters; the migrated stream's text is the same."""
    g = pb.generation_pb2
    n = 40
    want = check(cl, pb, 1, EMOJI, n, min_cuts=n // 4, ignore_eos=True, temperature=0.6,
                 seed=7, top_k=20, frequency_penalty=0.1)
    ids, text = want[0], want[1]
    assert any(ord(ch) > 0xFFFF for ch in text), text
    # at least one token alone is not whole UTF-8 (a character split across tokens)
    split = 0
    for t in ids:
        piece = ref.stub.Detokenize(g.DetokenizeRequest(ids=[t]), timeout=10).text
        split += "\ufffd" in piece
    assert split > 0, "no token of the reference splits a character"


def test_stop_strings_spanning_the_cuts(cl, pb):
    """Stop strings of 1..256 bytes cut from the reference's own text at several offsets:
    the first occurrence can only be found across the cuts (K=1 cuts at every message)."""
    g = pb.generation_pb2
    n = 90
    base = summary(stream(cl.ref.stub, g, PROSE, n, ignore_eos=True, **SAMPLED))
    raw = base[1].encode()
    assert len(raw) > 300, base[1]
    tried = 0
    for i, length in enumerate((1, 2, 3, 7, 16, 33, 64, 128, 256)):
        # near the end (the longest run: most cuts before the match) or earlier
        for start in ((len(raw) - length - 1) if i % 2 == 0 else (len(raw) - length) // 2,):
            stop = raw[start:start + length].decode(errors="ignore")
            if not stop:
                continue
            want = check(cl, pb, 1 + tried % 2, PROSE, n, min_cuts=0, ignore_eos=True,
                         stop=[stop], **SAMPLED)
            assert want[2] == g.FINISH_REASON_STOP, (length, start)
            tried += 1
    assert tried == 9
    cl.wait_idle()


STRUCTURED_SCHEMA = json.dumps({
    "type": "object", "additionalProperties": False, "required": ["title", "year", "tags"],
    "properties": {"title": {"type": "string", "maxLength": 40},
                   "year": {"type": "integer", "minimum": 1800, "maximum": 2030},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                            "maxItems": 3},
                   "rating": {"type": ["number", "null"], "minimum": 0, "maximum": 5}}})


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("kind", ["json_schema", "json_object", "regex", "choice"])
@pytest.mark.parametrize("prompt", ["short", "long"])
def test_structured_output_across_cuts(cl, pb, every, kind, prompt):
    """Structured outputs give the reference's bytes through the cluster with local
    (short prompt) and remote prefill (long: the prefill worker samples the first token
    under the grammar), with migrations after every `every`-th message: each new worker
    rebuilds the grammar state from the resumed tokens. Greedy and seeded sampling."""
    g = pb.generation_pb2
    text = ("Describe a book as JSON: " if prompt == "short"
            else PROSE + " Now describe the logbook as a JSON object: ")
    spec = {"json_schema": g.StructuredOutput(json_schema=STRUCTURED_SCHEMA),
            "json_object": g.StructuredOutput(json_object=True),
            # long enough for a cut every 3rd message when the draft model's seeded drafts
            # are all kept (5 tokens a message)
            "regex": g.StructuredOutput(regex=r"[A-Z][a-z]+( [a-z]+){24,32}\."),
            "choice": g.StructuredOutput(choice=g.Choices(
                choices=["a lighthouse keeper's logbook", "a ship's manifest", "a weather report"]))}[kind]
    sampling = dict(temperature=0.8, seed=11, top_p=0.95) if kind in ("json_object", "regex") else {}
    want = check(cl, pb, every, text, 96, min_cuts=1, structured=spec, **sampling)
    if want[2] == g.FINISH_REASON_STOP and kind == "json_schema":
        value = json.loads(want[1])
        assert set(value) >= {"title", "year", "tags"}, want[1]
    if kind == "choice":
        assert want[1] in ("a lighthouse keeper's logbook", "a ship's manifest", "a weather report")


def test_tools_chat_across_cuts(cl, pb):
    """A chat with tools in the prompt (Chat.tools, rendered by the template where the
    request enters: router or serve) and a tool-call history, constrained as tool_choice
    "required" constrains it: the same bytes as the single process with a cut after every
    message, remote prefill (the tools make the prompt long)."""
    g = pb.generation_pb2
    tool = json.dumps({"type": "function", "function": {
        "name": "log_ship", "description": "Record a ship in the logbook.",
        "parameters": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 30},
            "flag": {"type": "string", "enum": ["NO", "UK", "FR"]}},
            "required": ["name", "flag"]}}})
    schema = json.dumps({"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "required": ["name", "parameters"], "properties": {
            "name": {"type": "string", "enum": ["log_ship"]},
            "parameters": json.loads(tool)["function"]["parameters"]}}})
    chat = g.Chat(tools=[tool], messages=[
        g.ChatMessage(role="user", content="Log the Viking ship Draken."),
        g.ChatMessage(role="assistant", tool_calls=[g.ToolCall(
            id="c1", name="log_ship", arguments='{"name": "Draken", "flag": "NO"}')]),
        g.ChatMessage(role="tool", tool_call_id="c1", content="logged"),
        g.ChatMessage(role="user", content="Now log two British ships.")])

    def run(stub):
        return summary(list(stub.Generate(g.GenerateRequest(chat=chat, sampling=g.SamplingParams(
            max_tokens=80, temperature=0.7, seed=5,
            structured=g.StructuredOutput(json_schema=schema))), timeout=300)))

    r = cl.routers[1]
    wait_for_usable(r, len(cl.decode))
    want = run(cl.ref.stub)
    before = metric(r.metrics(), "chunkserve:migrations_total")
    got = run(r.stub)
    assert got[:4] == want[:4]
    assert metric(r.metrics(), "chunkserve:migrations_total") - before >= 1
    if want[2] == g.FINISH_REASON_STOP:
        calls = json.loads(want[1])
        assert all(c["name"] == "log_ship" and c["parameters"]["flag"] in ("NO", "UK", "FR")
                   for c in calls)


def prompt_logprobs(msgs):
    """The prompt logprobs of a stream, as (token, logprob, rank, alternatives): on one
    message, the first with tokens."""
    carrying = [i for i, m in enumerate(msgs) if m.prompt_logprobs]
    assert carrying == [next(i for i, m in enumerate(msgs) if m.token_ids)], carrying
    return [(e.token_id, e.logprob, e.rank, [(a.token_id, a.logprob) for a in e.top_logprobs])
            for e in msgs[carrying[0]].prompt_logprobs]


@pytest.mark.parametrize("prompt", ["short", "long"])
def test_prompt_logprobs_across_cuts(cl, pb, prompt):
    """Prompt logprobs through local (short) and remote prefill (long: computed by the
    prefill worker, sent in its reply, put by the router on the first message), with a cut
    after every message: once, bit for bit the single process's (the integer kernels give
    a row the same bits whatever the chunking), and the migrated legs do not ask again."""
    g = pb.generation_pb2
    text = "Three colours:" if prompt == "short" else PROSE
    sp = dict(ignore_eos=True, logprobs=True, prompt_logprobs=True, prompt_top_logprobs=3,
              **SAMPLED)
    r = cl.routers[1]
    wait_for_usable(r, len(cl.decode))
    want_msgs = stream(cl.ref.stub, g, text, 24, **sp)
    before = metric(r.metrics(), "chunkserve:migrations_total")
    got_msgs = stream(r.stub, g, text, 24, **sp)
    assert metric(r.metrics(), "chunkserve:migrations_total") - before >= 1
    want, got = summary(want_msgs), summary(got_msgs)
    assert got[:4] == want[:4] and same_logprobs(got[4], want[4])
    plp = prompt_logprobs(want_msgs)
    assert prompt_logprobs(got_msgs) == plp
    assert len(plp) == want[3][0] - 1 and all(len(e[3]) == 3 for e in plp)


def test_speculation_ran_on_both_sides(cl, pb):
    """Last in the module: a greedy stream whose answer repeats its prompt, cut after every
    second message, equals the single process; both decode workers verified drafts and
    kept some (their counters), and GetStatus names each one's kind."""
    code = ("Copy this list exactly: alpha beta gamma delta epsilon zeta eta theta iota kappa "
            "lambda mu nu xi omicron pi rho sigma tau.\nCopy: alpha beta gamma")
    check(cl, pb, 2, code, 40, min_cuts=1, ignore_eos=True, logprobs=True, top_logprobs=2)
    for w, kind in zip(cl.decode, ("ngram", "draft")):
        drafts = metric(w.metrics(), "chunkserve:spec_decode_num_draft_tokens_total")
        kept = metric(w.metrics(), "chunkserve:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 0 < kept <= drafts, (kind, drafts, kept)
        assert cl.status(w).speculative == kind
