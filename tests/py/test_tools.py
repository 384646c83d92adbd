"""Tools / function calling on /v1/chat/completions with the official `openai` client.

The prompt: Qwen2.5's chat template with tools, tool calls and tool messages, byte for byte
as jinja2 renders the model's own template (tests/fixtures/chat_tools_qwen2.5.json, made by
tools/fixtures/make_tools_fixture.py), compared through /tokenize. The answer: tool_choice
auto (the model's <tool_call> blocks, Qwen2.5-Coder-0.5B), required and a named function
(constrained by the tools' parameter schemas: the arguments always parse and validate, on
SmolLM2 too), parallel_tool_calls, streaming equal to one response; bad tool fields refused
naming them.
"""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("grpc_tools.protoc")

from test_openai import Serve  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_tools_qwen2.5.json"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def pb(proto_modules):
    return type("PB", (), proto_modules)


@pytest.fixture(scope="module")
def smol(chunkserve_bin, model_path, pb):
    s = Serve(chunkserve_bin, model_path, pb, "--threads", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def qwen(chunkserve_bin, named_model, pb):
    s = Serve(chunkserve_bin, named_model("qwen2.5-coder-0.5b"), pb, "--threads", "2")
    yield s
    s.stop()


def post(s, path, body):
    req = urllib.request.Request(f"http://{s.http}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def ask(s, content, stream=False, **kw):
    kw.setdefault("max_tokens", 200)
    return s.client.chat.completions.create(
        model=s.model, messages=[{"role": "user", "content": content}], tools=TOOLS,
        temperature=0, stream=stream, **kw)


def calls_of(message_or_delta):
    return [(c.function.name, json.loads(c.function.arguments))
            for c in (message_or_delta.tool_calls or [])]


def streamed(chunks):
    """(content, [(name, args)], finish) of a streamed answer."""
    content, calls, finish = "", [], None
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            assert tc.id.startswith("call_") and tc.type == "function"
            calls.append((tc.function.name, json.loads(tc.function.arguments)))
        finish = ch.finish_reason or finish
    return content, calls, finish


def test_template_with_tools_matches_jinja(qwen):
    cases = json.loads(FIXTURE.read_text())["cases"]
    assert len(cases) == 5
    for i, case in enumerate(cases):
        got = post(qwen, "/tokenize", {"messages": case["messages"], "tools": case["tools"],
                                       "add_special_tokens": False})
        want = post(qwen, "/tokenize", {"prompt": case["text"], "add_special_tokens": False})
        assert got["tokens"] == want["tokens"], f"case {i}"


def test_named_function(smol):
    r = ask(smol, "What is 2 plus 40?",
            tool_choice={"type": "function", "function": {"name": "add"}})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None
    (name, args), = calls_of(c.message)
    assert name == "add"
    jsonschema.validate(args, SCHEMAS["add"])
    assert c.message.tool_calls[0].id.startswith("call_")
    content, calls, finish = streamed(ask(
        smol, "What is 2 plus 40?", stream=True,
        tool_choice={"type": "function", "function": {"name": "add"}}))
    assert (content, calls, finish) == ("", [(name, args)], "stop")


@pytest.mark.parametrize("parallel", [True, False])
def test_required(smol, parallel):
    r = ask(smol, "Weather in Paris and in Rome, and 3 plus 4?", tool_choice="required",
            parallel_tool_calls=parallel)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    calls = calls_of(c.message)
    assert calls and (parallel or len(calls) == 1)
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])
    assert streamed(ask(smol, "Weather in Paris and in Rome, and 3 plus 4?", stream=True,
                        tool_choice="required", parallel_tool_calls=parallel)) == \
        ("", calls, "tool_calls")


def test_auto_and_the_conversation_after(qwen):
    """Qwen2.5-Coder-0.5B calls the weather tool itself (greedy; it writes the call as a
    ```json object, read as a call); the call and the tool's answer go back in the
    history."""
    q = "What is the weather like in Paris today, in celsius?"
    r = ask(qwen, q)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message.content
    (name, args), = calls_of(c.message)
    assert name == "get_weather" and "Paris" in args["city"], args
    s_content, s_calls, s_finish = streamed(ask(qwen, q, stream=True))
    assert (s_content or None, s_calls, s_finish) == (c.message.content, [(name, args)],
                                                       "tool_calls")
    history = [{"role": "user", "content": q},
               {"role": "assistant", "content": c.message.content,
                "tool_calls": [tc.model_dump() for tc in c.message.tool_calls]},
               {"role": "tool", "tool_call_id": c.message.tool_calls[0].id,
                "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    # the tool's answer in the history; tool_choice none: the answer is text
    r2 = qwen.client.chat.completions.create(model=qwen.model, messages=history, tools=TOOLS,
                                             tool_choice="none", temperature=0, max_tokens=60)
    assert r2.choices[0].message.content and r2.choices[0].message.tool_calls is None
    # tool_choice none: tools rendered, the answer read as text
    r3 = ask(qwen, q, tool_choice="none")
    assert r3.choices[0].message.tool_calls is None
    assert r3.choices[0].finish_reason in ("stop", "length")


def test_generic_template_on_smollm2(smol):
    """SmolLM2's template has no tools section: the same Qwen2.5-form section follows its
    system message (docs/tools.md); the history's calls and tool messages render."""
    a = post(smol, "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                 "tools": TOOLS})
    b = post(smol, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert a["count"] > b["count"] + 50
    r = smol.client.chat.completions.create(
        model=smol.model, tools=TOOLS, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "add 1 and 2"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "x", "type": "function",
                       "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}]},
                  {"role": "tool", "tool_call_id": "x", "content": "3"}])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_refused_naming_the_field(smol):
    bad = [
        (dict(tool_choice="required"), "tool_choice", "only allowed when tools"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice", "not in tools"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "sometimes"),
        (dict(tools=[{"type": "retrieval"}]), "tools", "function"),
        (dict(tools=[WEATHER, WEATHER]), "tools", "two tools"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools", "name"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
         "tool_choice", "structured"),
        (dict(tools=TOOLS, tool_choice="required", stream=True, logprobs=True), "logprobs",
         "tool calls"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"oneOf": [{"type": "string"}]}}}}}],
            tool_choice="required"), "tools", "oneOf"),
        (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]),
         "messages[0].tool_calls[0]", "JSON object"),
        (dict(messages=[{"role": "user", "content": "x", "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
         "messages[0].tool_calls", "only assistant"),
    ]
    for kw, param, needle in bad:
        kw.setdefault("messages", [{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError) as ei:
            r = smol.client.chat.completions.create(model=smol.model, max_tokens=4, **kw)
            if kw.get("stream"):
                list(r)
        err = ei.value.body
        assert err["param"] == param and needle in err["message"], (kw, err)


def test_auto_reads_tool_call_blocks(smol):
    """The <tool_call> block form (Qwen2.5's), here made certain by a regex constraint on
    SmolLM2: the text before the block is the content, the block a call; streamed, the
    content arrives first (the tag and the line break before it held back), then the call."""
    regex = (r'Let me check the weather\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>')
    kw = dict(extra_body={"guided_regex": regex}, max_tokens=80)
    r = ask(smol, "Weather in Paris?", **kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == "Let me check the weather."
    (name, args), = calls_of(c.message)
    assert name == "get_weather" and args["city"] in ("Paris", "Rome")
    assert streamed(ask(smol, "Weather in Paris?", stream=True, **kw)) == \
        ("Let me check the weather.", [(name, args)], "tool_calls")


def test_required_with_refs_and_odd_answers(smol):
    """tool_choice required with a pydantic-style tool ($defs and $ref in its parameters: the
    definitions move with the tool), and answers auto mode must read as content: a one-line
    ``` fence, an object naming no tool."""
    book = {"type": "function", "function": {"name": "add_book", "parameters": {
        "type": "object", "$defs": {"Author": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20}}, "required": ["name"]}},
        "properties": {"title": {"type": "string", "maxLength": 30},
                       "author": {"$ref": "#/$defs/Author"}},
        "required": ["title", "author"]}}}
    r = smol.client.chat.completions.create(
        model=smol.model, messages=[{"role": "user", "content": "Add Dune by Frank Herbert."}],
        tools=[book, ADD], tool_choice="required", temperature=0, max_tokens=120)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    for name, args in calls_of(c.message):
        schema = dict(book["function"]["parameters"]) if name == "add_book" else SCHEMAS[name]
        jsonschema.validate(args, schema)
    for regex, content in ((r"```\{\}```", "```{}```"),
                           (r'\{"name": "nope", "arguments": \{\}\}',
                            '{"name": "nope", "arguments": {}}')):
        r = ask(smol, "hi", max_tokens=30, extra_body={"guided_regex": regex})
        assert r.choices[0].message.content == content and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"
        assert streamed(ask(smol, "hi", stream=True, max_tokens=30,
                            extra_body={"guided_regex": regex})) == (content, [], "stop")
