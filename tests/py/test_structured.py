"""Structured outputs on `chunkserve serve` with the official `openai` client and gRPC.

response_format json_schema / json_object, vLLM's structured_outputs and guided_* fields,
the gRPC StructuredOutput (regex, choice): every answer that ends by end-of-generation
parses and validates against its schema with the `jsonschema` package (120 generated
schemas, greedy and seeded sampling, concurrent), matches its regex (Python's `re`), or is
one of the choices; streaming gives the same text as one response; what cannot be followed
is refused naming the field. Byte-identical answers through the cluster and across
migrations: test_migration.py.
"""
from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("grpc_tools.protoc")

from test_openai import Serve  # noqa: E402


@pytest.fixture(scope="module")
def pb(proto_modules):
    return type("PB", (), proto_modules)


@pytest.fixture(scope="module")
def srv(chunkserve_bin, model_path, pb):
    s = Serve(chunkserve_bin, model_path, pb, "--threads", "2", "--max-num-seqs", "16")
    # A 2-thread engine beside CPU hogs (make test-stress) waits on the scheduler at each of
    # a step's ~450 thread-pool barriers: a 300-token answer took over 120 s there (2 s idle).
    s.client = s.client.with_options(timeout=600)
    yield s
    s.stop()


def random_schema(rng: random.Random, depth=0) -> dict:
    """An object schema of the kinds users write (pydantic-like), bounded so every
    output ends: strings with maxLength, arrays with maxItems."""
    props, required = {}, []
    names = ["name", "id", "title", "count", "price", "tags", "active", "kind", "meta", "when",
             "code", "score", "note", "items", "owner"]
    for name in rng.sample(names, rng.randint(1, 4)):
        props[name] = random_value_schema(rng, depth)
        if rng.random() < 0.7:
            required.append(name)
    s = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        s["required"] = required
    return s


def random_value_schema(rng: random.Random, depth: int) -> dict:
    k = rng.randrange(12 if depth < 1 else 10)
    if k == 0:
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if k == 1:
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "é-ü", "a b"], 3)}
    if k == 2:
        return {"type": "string", "pattern": "^[a-z]{1,5}-[0-9]{2}$"}
    if k == 3:
        return {"type": "string", "format": rng.choice(["date", "uuid", "date-time"])}
    if k == 4:
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 300)}
    if k == 5:
        return {"type": "number", "minimum": 0, "maximum": rng.randint(1, 100)}
    if k == 6:
        return {"type": "boolean"}
    if k == 7:
        return {"type": ["integer", "null"], "minimum": 0, "maximum": 9}
    if k == 8:
        return {"anyOf": [{"type": "string", "maxLength": 4}, {"const": 42}]}
    if k == 9:
        return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    if k == 10:
        return {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}
    return random_schema(rng, depth + 1)


def chat(srv, content, **kw):
    return srv.client.chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": content}], **kw)


def test_generated_schemas_validate(srv):
    """120 schemas, half greedy and half seeded sampling, 8 at a time: every output
    ends by end-of-generation and validates."""
    rng = random.Random(20261205)
    schemas = [random_schema(rng) for _ in range(120)]

    def one(i):
        s = schemas[i]
        kw = dict(temperature=0) if i % 2 == 0 else dict(temperature=0.8, seed=i, top_p=0.95)
        r = chat(srv, f"Give an example JSON object with the fields {', '.join(s['properties'])}.",
                 max_tokens=400, response_format={"type": "json_schema", "json_schema": {
                     "name": f"s{i}", "schema": s, "strict": True}}, **kw)
        return r.choices[0]

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(len(schemas))))
    for i, c in enumerate(results):
        assert c.finish_reason == "stop", (i, schemas[i], c.message.content)
        value = json.loads(c.message.content)
        jsonschema.validate(value, schemas[i])


def test_json_object_and_streaming(srv):
    kw = dict(max_tokens=120, temperature=0, response_format={"type": "json_object"})
    r = chat(srv, "Describe a city as a JSON object with two short fields.", **kw)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    else:  # cut by max_tokens: still a prefix of an object
        assert text.startswith("{"), text
    chunks = chat(srv, "Describe a city as a JSON object with two short fields.", stream=True,
                  **kw)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text


def test_regex_choice_and_vllm_fields(srv):
    c = srv.client.completions.create(model=srv.model, prompt="My phone number is",
                                      max_tokens=30, temperature=0.7, seed=3,
                                      extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", c.choices[0].text), c.choices[0].text
    assert c.choices[0].finish_reason == "stop"
    for body in ({"guided_choice": ["Paris", "London", "Rome"]},
                 {"structured_outputs": {"choice": ["Paris", "London", "Rome"]}}):
        c = srv.client.completions.create(model=srv.model, prompt="The capital of France is",
                                          max_tokens=10, temperature=0, extra_body=body)
        assert c.choices[0].text in ("Paris", "London", "Rome"), c.choices[0].text
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"]}
    for body in ({"guided_json": schema}, {"structured_outputs": {"json": schema}},
                 {"guided_json": json.dumps(schema)}):
        r = srv.client.chat.completions.create(
            model=srv.model, messages=[{"role": "user", "content": "A city as JSON."}],
            max_tokens=200, temperature=0, extra_body=body)
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_grpc_regex_and_choice(srv, pb):
    g = pb.generation_pb2
    msgs = list(srv.stub.Generate(g.GenerateRequest(
        prompt="Today's date:", sampling=g.SamplingParams(
            max_tokens=20, temperature=0.5, seed=9,
            structured=g.StructuredOutput(regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"))),
        timeout=120))
    text = "".join(m.text for m in msgs)
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", text), text
    assert msgs[-1].finish_reason == g.FINISH_REASON_STOP
    msgs = list(srv.stub.Generate(g.GenerateRequest(
        prompt="Is the sky blue? Answer:", sampling=g.SamplingParams(
            max_tokens=5, structured=g.StructuredOutput(
                choice=g.Choices(choices=[" yes", " no"])))), timeout=120))
    assert "".join(m.text for m in msgs) in (" yes", " no")


def test_refused_by_name(srv, pb):
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"oneOf": []}}}},
         "response_format", "oneOf"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
         "give one"),
        ({"guided_regex": "(a"}, "guided_regex", "unclosed"),
        ({"guided_choice": []}, "guided_choice", "array"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "grammar"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
        ({"guided_grammar": "root ::= x"}, "guided_grammar", "guided_grammar"),
    ]
    for extra, param, needle in bad:
        with pytest.raises(openai.BadRequestError) as ei:
            srv.client.chat.completions.create(
                model=srv.model, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                extra_body=extra)
        err = ei.value.body
        assert err["param"] == param and needle in err["message"], (extra, err)
    g = pb.generation_pb2
    import grpc
    with pytest.raises(grpc.RpcError) as ei:
        list(srv.stub.Generate(g.GenerateRequest(prompt="x", sampling=g.SamplingParams(
            max_tokens=5, structured=g.StructuredOutput(regex="a(?=b)"))), timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lookaround" in ei.value.details()
    # the server still answers normally
    r = chat(srv, "Say hi.", max_tokens=4)
    assert r.choices[0].message.content
