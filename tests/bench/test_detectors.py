"""The repro detectors, each on a crafted bad reply (fires) and a good one (silent); the Wilson
interval and the divergence highlight."""

from __future__ import annotations

import json

import pytest

from kvrelay.bench.detectors import (
    Reply,
    cut_unfinished,
    detect,
    leaked_special_tokens,
    ngram_loop,
    parse_text_calls,
    schema_violations,
    tag_imbalance,
    tools_by_name,
)
from kvrelay.bench.repro_report import highlight, wilson
from kvrelay.bench.workloads import TOOLS

SCHEMAS = tools_by_name(TOOLS)
D = "｜DSML｜"
GOOD_JSON_CALL = '<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>'
GOOD_DSML = (
    f'\n\n<{D}tool_calls>\n<{D}invoke name="read_file">\n'
    f'<{D}parameter name="path" string="true">a.py</{D}parameter>\n'
    f"</{D}invoke>\n</{D}tool_calls>"
)


def kinds(reply: Reply) -> list[str]:
    return sorted({f.detector for f in detect(reply, SCHEMAS)})


def test_a_clean_reply_has_no_findings():
    assert kinds(Reply("I will read the file first. " + GOOD_JSON_CALL, finish_reason="stop")) == []
    assert kinds(Reply("Let me look." + GOOD_DSML, finish_reason="stop")) == []
    call = {"id": "c", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}
    call["function"]["arguments"] = json.dumps({"target": "tests/x.py"})
    assert kinds(Reply("", tool_calls=[call], finish_reason="tool_calls")) == []


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "read_file", "arguments": {"path": "a.py"</tool_call>',  # bad JSON
        "<tool_call>[1, 2]</tool_call>",  # not an object
        f'<{D}tool_calls>\n<{D}invoke name="read_file">\n<{D}parameter name="path" string="false">'
        f"a.py</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>",  # string=false, not JSON
        f"text with a stray {D} marker",
    ],
)
def test_tool_parse_failures(text):
    assert "tool_parse" in kinds(Reply(text, finish_reason="stop"))


def test_parse_text_calls_reads_both_formats():
    calls, errors = parse_text_calls("a " + GOOD_JSON_CALL + " b" + GOOD_DSML)
    assert errors == []
    assert [c["function"]["name"] for c in calls] == ["read_file", "read_file"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"path": "a.py"}


def test_a_call_cut_off_by_max_tokens_is_not_a_parse_failure():
    cut = 'Reading. <tool_call>{"name": "read_file", "argu'
    assert kinds(Reply(cut, finish_reason="length")) == []
    assert cut_unfinished(cut) == "Reading. "
    assert "tool_parse" in kinds(Reply(cut, finish_reason="stop"))  # stopped there: broken


def test_schema_violations():
    schema = SCHEMAS["search_code"]
    assert schema_violations('{"query": "x", "max_results": 5}', schema) == []
    assert schema_violations('{"max_results": 5}', schema) == ["missing required 'query'"]
    assert schema_violations('{"query": 3}', schema) == ["'query' should be string, got int"]
    assert schema_violations('{"query": "x", "max_results": true}', schema)  # bool is no integer
    assert schema_violations('{"query": "x", "max_results": 99}', schema)  # above maximum
    assert schema_violations("[1]", schema) == ["arguments are not a JSON object"]
    strict = {"properties": {"a": {"type": "string", "enum": ["x"]}}, "additionalProperties": False}
    assert schema_violations('{"a": "y", "b": 1}', strict) == [
        "'a' = 'y' is not one of ['x']",
        "unknown argument 'b'",
    ]


def test_schema_detector_on_calls():
    bad = '<tool_call>{"name": "read_file", "arguments": {"start_line": "one"}}</tool_call>'
    assert kinds(Reply(bad, finish_reason="stop")) == ["tool_schema"]
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert kinds(Reply(unknown, finish_reason="stop")) == ["tool_schema"]
    server_call = {"function": {"name": "edit_file", "arguments": '{"path": "a"}'}}
    assert kinds(Reply("", tool_calls=[server_call], finish_reason="tool_calls")) == ["tool_schema"]


def test_tag_balance():
    assert tag_imbalance("<think>plan</think>answer") == []
    assert tag_imbalance("plan</think>answer") == []  # the template opened the think block
    assert tag_imbalance("a</think>b</think>")  # a second close has no open
    assert tag_imbalance("<think>plan, never closed")
    assert tag_imbalance("<think>plan, cut off", truncated=True) == []
    assert tag_imbalance("<think><think></think></think>")  # nested in itself
    assert tag_imbalance(f'<{D}tool_calls>\n<{D}invoke name="x">\n</{D}tool_calls>')
    assert tag_imbalance(GOOD_DSML) == []
    assert kinds(Reply("done </tool_call> oops", finish_reason="stop")) == ["tag_balance"]


def test_leaked_special_tokens():
    assert leaked_special_tokens("hello <|im_start|>user", [], True) == ["<|im_start|>"]
    assert leaked_special_tokens("x <｜end▁of▁sentence｜> y", [], True) == ["<｜end▁of▁sentence｜>"]
    assert leaked_special_tokens("plain text", ["plain", "<|im_end|>"], stopped=True) == []
    assert leaked_special_tokens("plain", ["<|endoftext|>", "plain"], stopped=True)
    assert leaked_special_tokens(GOOD_DSML, [], True) == []  # DSML tags are not special tokens
    assert kinds(Reply("ok <|endoftext|> more", finish_reason="stop")) == ["special_token"]


def test_ngram_loop():
    assert ngram_loop(["a", "b", "c", "d"] * 5) is not None
    assert ngram_loop(["!"] * 16) is not None
    assert ngram_loop(["!"] * 15) is None  # too short a span
    assert ngram_loop([" "] * 40) is None  # whitespace runs are layout
    assert ngram_loop([f"w{i}" for i in range(64)]) is None
    looping = Reply(content="", tokens=[" I", " am", " sorry", "."] * 6, finish_reason="length")
    assert kinds(looping) == ["ngram_loop"]
    words = Reply(content="the same thing " * 8, finish_reason="length")  # no tokens: words
    assert kinds(words) == ["ngram_loop"]


def test_wilson_interval():
    lo, hi = wilson(0, 200)
    assert lo == 0.0 and 0.015 < hi < 0.02  # the "rule of three" region
    lo, hi = wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0)


def test_highlight_marks_the_divergence():
    assert highlight(["a", "b", "c"], ["a", "x", "y"], 1) == "a[[b|x]]y"
    assert highlight(["a"], ["a", "z"], 1) == "a[[∅|z]]"
    assert highlight(["q" * 10, "b"], ["q" * 10, "c"], 1, before=4) == "…qqqq[[b|c]]"
