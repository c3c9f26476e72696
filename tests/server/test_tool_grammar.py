"""Forced tool-call grammars (server/tools/tool_grammar.py): what the chat encoders write for a
call is accepted by llguidance under the grammar, and the grammar's output parses into the call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.server.tools.dsml import ToolCall, encode_tool_calls, parse_message
from kvrelay.server.tools.json_calls import JsonToolCallStreamParser
from kvrelay.server.tools.tool_grammar import dsml_calls_grammar, json_calls_grammar
from kvrelay.server.tools.tool_prompt import call_text

llguidance = pytest.importorskip("llguidance")
AGENT = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "dsv4-tiny-agent"

FUNCTIONS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
    {"name": "ping"},
]
CALLS = [
    ToolCall("", "get_weather", json.dumps({"city": "Lima </b> ｜", "days": 3, "unit": "f"})),
    ToolCall("", "ping", "{}"),
]


@pytest.fixture(scope="module")
def tokenizer():
    """A fast HF tokenizer and its llguidance twin (the dsv4-tiny-agent's, else SmolLM2's)."""
    import llguidance.hf
    from transformers import AutoTokenizer

    if (AGENT / "tokenizer.json").is_file():
        hf = AutoTokenizer.from_pretrained(str(AGENT))
    else:
        from kvrelay.weights.loader import resolve
        from kvrelay.weights.tokenizer import load_tokenizer

        hf = load_tokenizer(resolve("smollm2"))
    return hf, llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))


def _matches(tokenizer, lark: str, text: str, prefix_ids: list[int] = ()) -> bool:
    from llguidance import LLMatcher

    hf, ll = tokenizer
    grammar = LLMatcher.grammar_from_lark(lark)
    assert LLMatcher.validate_grammar_with_warnings(grammar, ll) == (False, [])
    m = LLMatcher(ll, grammar)
    ids = [*prefix_ids, *hf.encode(text, add_special_tokens=False)]
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_dsml_grammar_accepts_the_encoders_calls(tokenizer) -> None:
    text = encode_tool_calls(CALLS)
    assert _matches(tokenizer, dsml_calls_grammar(FUNCTIONS, parallel=True), text)
    assert not _matches(tokenizer, dsml_calls_grammar(FUNCTIONS, parallel=False), text)
    one = encode_tool_calls(CALLS[:1])
    assert _matches(tokenizer, dsml_calls_grammar(FUNCTIONS[:1], parallel=False), one)
    assert not _matches(tokenizer, dsml_calls_grammar(FUNCTIONS[1:], parallel=True), one)
    bad = one.replace('"days" string="false">3', '"days" string="false">"3"')
    assert not _matches(tokenizer, dsml_calls_grammar(FUNCTIONS, parallel=True), bad)
    parsed = parse_message(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (c.name, json.loads(c.arguments)) for c in CALLS
    ]


def test_dsml_grammar_in_thinking_mode(tokenizer) -> None:
    hf, _ = tokenizer
    end = hf.convert_tokens_to_ids("</think>")
    if not isinstance(end, int) or end == hf.unk_token_id:
        pytest.skip("this tokenizer has no </think> token")
    lark = dsml_calls_grammar(FUNCTIONS, parallel=False, think_end=f"<[{end}]>")
    reasoning = hf.encode("Weather: call it.", add_special_tokens=False) + [end]
    assert _matches(tokenizer, lark, encode_tool_calls(CALLS[1:]), reasoning)


def test_json_grammar_accepts_the_prompted_format(tokenizer) -> None:
    calls = [{"function": {"name": c.name, "arguments": c.arguments}} for c in CALLS]
    # The compact layout the grammar writes: one call per block, blocks one line apart.
    text = call_text(calls)
    assert _matches(tokenizer, json_calls_grammar(FUNCTIONS, parallel=True), text)
    assert not _matches(tokenizer, json_calls_grammar(FUNCTIONS, parallel=False), text)
    wrong = text.replace('"days": 3', '"days": "3"')
    assert not _matches(tokenizer, json_calls_grammar(FUNCTIONS, parallel=True), wrong)
    parser = JsonToolCallStreamParser()
    out = parser.feed(text) + parser.finish()
    assert [(d.name, json.loads(d.arguments)) for d in out] == [
        (c.name, json.loads(c.arguments)) for c in CALLS
    ]
