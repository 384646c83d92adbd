"""chunkserve's tokenizer and chat template vs the golden fixtures from llama.cpp / HF.

The fixtures tests/fixtures/tokenizer_<model>.json are made by
tools/fixtures/make_tokenizer_fixture.py (llama.cpp ids, cross-checked with HF tokenizers;
chat text rendered by transformers' chat-template machinery): SmolLM2 (the default model),
Qwen2.5-Coder-0.5B (fetched by `make test`) and Qwen2.5-Coder-1.5B (a benchmark model: its
tests skip when models/ does not hold it).  These tests only need the Python stdlib, pytest and
the built `chunkserve` CLI:

  chunkserve tokenize --model PATH [--no-special]   JSON-string lines in, JSON id-array lines out
  chunkserve detokenize --model PATH                JSON id-array lines in, JSON-string lines out
  chunkserve chat-format --model PATH [--no-generation-prompt]
                                                    one JSON message array in, the prompt text out
"""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import CLI

MAX_REPORTED = 8
# fixture file -> the model it was made from (None: the default model, CHUNKSERVE_MODEL)
FIXTURES = {"tokenizer_smollm2.json": None,
            "tokenizer_qwen2.5-coder-0.5b.json": "qwen2.5-coder-0.5b",
            "tokenizer_qwen2.5-coder-1.5b.json": "qwen2.5-coder-1.5b",
            "tokenizer_gemma3-270m.json": "gemma3-270m"}


@pytest.fixture(scope="module", params=list(FIXTURES), ids=lambda f: f[len("tokenizer_"):-5])
def which(request):
    return request.param


@pytest.fixture(scope="module")
def fx(fixtures_dir, which) -> dict:
    with open(fixtures_dir / which, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def cli(chunkserve_bin, model_path, named_model, which) -> CLI:
    """The CLI on the fixture's own model."""
    name = FIXTURES[which]
    return CLI(chunkserve_bin, named_model(name) if name else model_path)


def _report(label: str, bad: list, total: int) -> str:
    lines = [f"{label}: {len(bad)}/{total} cases differ; first {min(len(bad), MAX_REPORTED)}:"]
    for text, want, got in bad[:MAX_REPORTED]:
        lines.append(f"  text={text!r}\n    expected={want}\n    got     ={got}")
    return "\n".join(lines)


def test_fixture_is_well_formed(fx):
    """Runs without the binary: the committed fixture has what the tests rely on."""
    assert len(fx["cases"]) >= 320
    assert len(fx["chat_cases"]) >= (6 if fx["model"]["tokenizer.ggml.pre"] == "smollm" else 100)
    assert fx["no_special_cases"]
    texts = [c["text"] for c in fx["cases"]]
    assert "" in texts
    assert any("<|im_start|>" in t or "<start_of_turn>" in t for t in texts)
    if fx["model"].get("tokenizer.ggml.model") == "llama":  # SentencePiece (Gemma)
        assert len(fx["cases"]) >= 2000 and fx["detok_cases"] and fx["chat_errors"]
    n_vocab = fx["model"]["n_vocab"]
    for c in fx["cases"] + fx["no_special_cases"]:
        assert all(0 <= i < n_vocab for i in c["ids"]), c
    assert {c["add_generation_prompt"] for c in fx["chat_cases"]} == {True, False}


@pytest.mark.parametrize("ensure_ascii", [False, True], ids=["utf8", "json-escaped"])
def test_tokenize_matches_reference(cli, fx, ensure_ascii):
    cases = fx["cases"]
    out = cli.run("tokenize", stdin=cli.json_lines_in([c["text"] for c in cases], ensure_ascii))
    got = cli.json_lines_out(out, len(cases))
    bad = [(c["text"], c["ids"], g) for c, g in zip(cases, got) if g != c["ids"]]
    print(f"\ntokenize ({'escaped' if ensure_ascii else 'utf8'} input): "
          f"{len(cases) - len(bad)}/{len(cases)} cases exact")
    assert not bad, _report("tokenize", bad, len(cases))


def test_tokenize_no_special_matches_reference(cli, fx):
    cases = fx["no_special_cases"]
    out = cli.run("tokenize", "--no-special", stdin=cli.json_lines_in([c["text"] for c in cases]))
    got = cli.json_lines_out(out, len(cases))
    bad = [(c["text"], c["ids"], g) for c, g in zip(cases, got) if g != c["ids"]]
    print(f"\ntokenize --no-special: {len(cases) - len(bad)}/{len(cases)} cases exact")
    assert not bad, _report("tokenize --no-special", bad, len(cases))


def test_detokenize_reference_ids(cli, fx):
    cases = fx["cases"] + fx["no_special_cases"]
    out = cli.run("detokenize", stdin=cli.json_lines_in([c["ids"] for c in cases]))
    got = cli.json_lines_out(out, len(cases))
    bad = [(c["ids"], c["text"], g) for c, g in zip(cases, got) if g != c["text"]]
    assert not bad, _report("detokenize(reference ids)", bad, len(cases))


def test_decode_encode_round_trip(cli, fx):
    texts = [c["text"] for c in fx["cases"]]
    ids = cli.json_lines_out(cli.run("tokenize", stdin=cli.json_lines_in(texts)), len(texts))
    back = cli.json_lines_out(cli.run("detokenize", stdin=cli.json_lines_in(ids)), len(texts))
    bad = [(t, t, b) for t, b in zip(texts, back) if b != t]
    assert not bad, _report("decode(encode(s)) != s", bad, len(texts))


def test_chat_format_matches_reference(cli, fx):
    bad = []
    for c in fx["chat_cases"]:
        args = [] if c["add_generation_prompt"] else ["--no-generation-prompt"]
        out = cli.run("chat-format", *args,
                      stdin=json.dumps(c["messages"], ensure_ascii=False).encode("utf-8"))
        got = out.decode("utf-8")
        if got != c["text"]:
            bad.append((c["messages"], c["text"], got))
    print(f"\nchat-format: {len(fx['chat_cases']) - len(bad)}/{len(fx['chat_cases'])} exact")
    assert not bad, "\n".join(
        f"messages={m!r} (add_generation_prompt differs?)\n  expected={w!r}\n  got     ={g!r}"
        for m, w, g in bad[:MAX_REPORTED])


def test_chat_text_tokenizes_like_reference(cli, fx):
    cases = fx["chat_cases"]
    out = cli.run("tokenize", stdin=cli.json_lines_in([c["text"] for c in cases]))
    got = cli.json_lines_out(out, len(cases))
    bad = [(c["text"], c["ids"], g) for c, g in zip(cases, got) if g != c["ids"]]
    assert not bad, _report("tokenize(chat text)", bad, len(cases))


def test_detokenize_byte_fallback_pieces(cli, fx):
    """<0xNN> pieces that do not make whole characters (SentencePiece's byte fallback): each
    ill-formed part becomes U+FFFD, as Python's errors="replace" does with llama.cpp's bytes."""
    cases = fx.get("detok_cases") or []
    if not cases:
        pytest.skip("a byte-level BPE fixture: no byte-fallback pieces")
    out = cli.run("detokenize", stdin=cli.json_lines_in([c["ids"] for c in cases]))
    got = cli.json_lines_out(out, len(cases))
    bad = [(c["ids"], c["text"], g) for c, g in zip(cases, got) if g != c["text"]]
    assert not bad, _report("detokenize(byte pieces)", bad, len(cases))


def test_chat_format_refuses_what_the_template_refuses(cli, fx):
    """Conversations the model's own template rejects (Gemma: roles that do not alternate
    user/assistant) are refused with the template's reason, not rendered some other way."""
    cases = fx.get("chat_errors") or []
    if not cases:
        pytest.skip("the template renders every conversation of the fixture")
    for c in cases:
        args = [] if c["add_generation_prompt"] else ["--no-generation-prompt"]
        p = subprocess.run([str(cli.exe), "chat-format", "--model", str(cli.model), *args],
                           input=json.dumps(c["messages"], ensure_ascii=False).encode("utf-8"),
                           capture_output=True, timeout=60)
        assert p.returncode != 0 and b"alternate" in p.stderr, (c["messages"], p.stderr)
