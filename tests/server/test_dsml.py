"""DSML tool calls: encode→parse round trip, streamed parse == whole parse, malformed input."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.server.tools.dsml import (
    DSML,
    ContentDelta,
    DsmlStreamParser,
    ToolCall,
    ToolCallDelta,
    assemble,
    encode_tool_calls,
    parse_message,
)

# Characters that stress the format: quotes, newlines, angle brackets, the fullwidth bar of
# the DSML marker, CJK, emoji, and pieces of the tags themselves.
_TRICKY = st.sampled_from(
    ['"', "'", "\n", "\n\n", "<", ">", "</", "/>", "｜", "DSML", "杭州", "🙂", "\\", "{", "}",
     "parameter", "invoke", "tool_calls", " ", "\t", "<think>", "&amp;"]
)  # fmt: skip
_STR = st.lists(st.one_of(st.text(max_size=6), _TRICKY), max_size=6).map("".join)
# A raw string value cannot hold the DSML marker (the format has no escaping).
STRINGS = _STR.filter(lambda s: DSML not in s)
KEYS = STRINGS.filter(lambda s: s and '"' not in s)
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,15}", fullmatch=True)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    STRINGS,
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(KEYS, inner, max_size=3)),
    max_leaves=8,
)
ARGS = st.dictionaries(KEYS, JSON, max_size=4)
CALLS = st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=4)


def _calls(specs: list[tuple[str, dict]]) -> list[ToolCall]:
    return [
        ToolCall(f"call_{i}", name, json.dumps(args, ensure_ascii=False))
        for i, (name, args) in enumerate(specs)
    ]


def _stream(text: str, cuts: list[int]) -> tuple[str, list[ToolCall], list[str]]:
    parser = DsmlStreamParser()
    deltas = []
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        deltas += parser.feed(text[a:b])
    deltas += parser.finish()
    assert all(not (isinstance(d, ContentDelta) and d.text == "") for d in deltas)
    content, calls = assemble(deltas)
    return content, calls, parser.errors


def _assert_stream_equals_whole(text: str, rng: random.Random, splits: int = 6) -> None:
    whole = parse_message(text)
    ways = [list(range(len(text)))]  # 1-char pieces
    ways += [
        [rng.randrange(len(text) + 1) for _ in range(rng.randint(0, 12))] for _ in range(splits)
    ]
    for cuts in ways:
        assert _stream(text, cuts) == (whole.content, whole.tool_calls, whole.errors), cuts


# ---------------------------------------------------------------------- round trip


def test_encode_exact_format() -> None:
    calls = [
        ToolCall("a", "get_weather", '{"city": "杭州", "days": 5}'),
        ToolCall("b", "ping", "{}"),
    ]
    assert encode_tool_calls(calls) == (
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">杭州</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">5</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="ping">\n'
        "\n"
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>"
    )
    assert encode_tool_calls([]) == ""


def test_encode_non_string_values_are_json() -> None:
    args = {"n": 1.5, "b": False, "z": None, "l": [1, "x"], "o": {"k": "v"}, "s": "1"}
    text = encode_tool_calls([ToolCall("c", "f", json.dumps(args))])
    assert '<｜DSML｜parameter name="n" string="false">1.5</｜DSML｜parameter>' in text
    assert '<｜DSML｜parameter name="b" string="false">false</｜DSML｜parameter>' in text
    assert '<｜DSML｜parameter name="z" string="false">null</｜DSML｜parameter>' in text
    assert '<｜DSML｜parameter name="l" string="false">[1, "x"]</｜DSML｜parameter>' in text
    assert '<｜DSML｜parameter name="o" string="false">{"k": "v"}</｜DSML｜parameter>' in text
    assert '<｜DSML｜parameter name="s" string="true">1</｜DSML｜parameter>' in text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=STRINGS, specs=CALLS)
def test_round_trip(content: str, specs: list[tuple[str, dict]]) -> None:
    calls = _calls(specs)
    parsed = parse_message(content + encode_tool_calls(calls))
    assert parsed.errors == []
    assert parsed.content == content
    assert parsed.tool_calls == calls  # ids call_<n>, names, arguments byte-exact
    for call, (_, args) in zip(parsed.tool_calls, specs, strict=True):
        assert json.loads(call.arguments) == args


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=STRINGS, specs=CALLS, tail=STRINGS, seed=st.integers(0, 2**32))
def test_stream_equals_whole(content: str, specs, tail: str, seed: int) -> None:
    text = content + encode_tool_calls(_calls(specs)) + tail
    _assert_stream_equals_whole(text, random.Random(seed))


@settings(max_examples=100, deadline=None)
@given(text=st.lists(st.one_of(_TRICKY, st.sampled_from(
    [DSML, "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", '<｜DSML｜invoke name="f">',
     "</｜DSML｜invoke>", '<｜DSML｜parameter name="k" string="true">', "</｜DSML｜parameter>",
     '<｜DSML｜parameter name="k" string="false">', "<｜DSML｜tool", "\n\n"])), max_size=20
).map("".join), seed=st.integers(0, 2**32))  # fmt: skip
def test_stream_equals_whole_on_tag_soup(text: str, seed: int) -> None:
    # Arbitrary mixes of tags and text: never raises, and the split never matters.
    _assert_stream_equals_whole(text, random.Random(seed))


def test_ids_use_prefix_and_count() -> None:
    text = encode_tool_calls(_calls([("a", {}), ("b", {"x": 1})]))
    assert [c.id for c in parse_message(text, id_prefix="call_r7_").tool_calls] == [
        "call_r7_0",
        "call_r7_1",
    ]


# ----------------------------------------------------------------------- streaming


def test_stream_holds_back_possible_marker_and_releases_it() -> None:
    p = DsmlStreamParser()
    assert p.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert p.feed("ld\n\n<｜DSML｜to") == [
        ContentDelta("ld")
    ]  # "\n\n<｜DSML｜to" may start a block
    assert p.feed("ast>") == [ContentDelta("\n\n<｜DSML｜toast>")]  # it did not
    assert p.feed(" <") == [ContentDelta(" ")]
    assert p.finish() == [ContentDelta("<")]
    assert len(p.errors) == 1 and "outside a tool_calls block" in p.errors[0]


def test_stream_releases_each_call_when_its_invoke_closes() -> None:
    text = "Checking." + encode_tool_calls(_calls([("f", {"a": 1}), ("g", {"b": "x"})]))
    p = DsmlStreamParser()
    first_close = text.index("</｜DSML｜invoke>") + len("</｜DSML｜invoke>")
    out = p.feed(text[:first_close])
    assert out == [ContentDelta("Checking."), ToolCallDelta(0, "call_0", "f", '{"a": 1}')]
    assert p.feed(text[first_close:]) == [ToolCallDelta(1, "call_1", "g", '{"b": "x"}')]
    assert p.finish() == [] and p.errors == []


def test_text_after_block_is_content() -> None:
    parsed = parse_message("a" + encode_tool_calls(_calls([("f", {})])) + "\nb")
    assert parsed.content == "a\nb" and [c.name for c in parsed.tool_calls] == ["f"]


def test_accepts_variant_block_names_and_missing_string_attribute() -> None:
    text = (
        "<｜DSML｜toolcalls>\n"
        '<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="n">5</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="s">hi there</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜toolcalls>"
    )
    parsed = parse_message(text)
    assert parsed.errors == [] and parsed.content == ""
    assert json.loads(parsed.tool_calls[0].arguments) == {"n": 5, "s": "hi there"}


# ----------------------------------------------------------------------- malformed

_BLOCK = "<｜DSML｜tool_calls>\n{}\n</｜DSML｜tool_calls>"
_INV = '<｜DSML｜invoke name="f">\n{}\n</｜DSML｜invoke>'
_P = '<｜DSML｜parameter name="{}" string="{}">{}</｜DSML｜parameter>'

# (input text, the offending text that must come back as content)
MALFORMED = [
    pytest.param(
        "x\n\n<｜DSML｜tool_calls>\n"
        + '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" str',
        '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" str',
        id="unterminated-block-mid-parameter",
    ),
    pytest.param(
        _BLOCK.format(_INV.format(_P.format("a", "false", "{not json"))),
        _INV.format(_P.format("a", "false", "{not json")),
        id="bad-json-in-string-false",
    ),
    pytest.param(
        _BLOCK.format(_INV.format(_P.format("a", "false", "NaN"))),
        _INV.format(_P.format("a", "false", "NaN")),
        id="nan-is-not-json",
    ),
    pytest.param(
        _BLOCK.format("<｜DSML｜frobnicate>zz</｜DSML｜frobnicate>"),
        "<｜DSML｜frobnicate>zz",
        id="unknown-tag-in-block",
    ),
    pytest.param(
        _BLOCK.format("<｜DSML｜invoke>\n</｜DSML｜invoke>"),
        "<｜DSML｜invoke>\n</｜DSML｜invoke>",
        id="invoke-without-name-attribute",
    ),
    pytest.param(
        _BLOCK.format('<｜DSML｜invoke name="">\n</｜DSML｜invoke>'),
        '<｜DSML｜invoke name="">\n</｜DSML｜invoke>',
        id="invoke-with-empty-name",
    ),
    pytest.param(
        _BLOCK.format(_INV.format('<｜DSML｜parameter name="a" string="true">v')),
        _INV.format('<｜DSML｜parameter name="a" string="true">v'),
        id="unterminated-parameter",
    ),
    pytest.param(
        _BLOCK.format(
            _INV.format(_P.format("a", "true", "1") + "\n" + _P.format("a", "true", "2"))
        ),
        _INV.format(_P.format("a", "true", "1") + "\n" + _P.format("a", "true", "2")),
        id="duplicate-parameter",
    ),
    pytest.param(
        _BLOCK.format(_INV.format(_P.format("a", "maybe", "1"))),
        _INV.format(_P.format("a", "maybe", "1")),
        id="bad-string-attribute",
    ),
    pytest.param(
        _BLOCK.format(_INV.format("chatter " + _P.format("a", "true", "1"))),
        _INV.format("chatter " + _P.format("a", "true", "1")),
        id="text-inside-invoke",
    ),
    pytest.param(
        "see: " + _INV.format(_P.format("a", "true", "1")),
        "see: <｜DSML｜",
        id="invoke-outside-block",
    ),
    pytest.param(
        _BLOCK.format("I will now call a tool"),
        "I will now call a tool",
        id="text-inside-block",
    ),
    pytest.param("hello <｜DSML｜tool_c", "hello <｜DSML｜tool_c", id="truncated-block-start"),
    pytest.param(
        _BLOCK.format(_INV.format(_P.format("a", "true", "1")).replace("</｜DSML｜invoke>", "")),
        '<｜DSML｜invoke name="f">\n' + _P.format("a", "true", "1") + "\n\n",
        id="missing-invoke-close",
    ),
]


@pytest.mark.parametrize(("text", "offending"), MALFORMED)
def test_malformed_comes_back_as_content_with_error(text: str, offending: str) -> None:
    parsed = parse_message(text)
    assert parsed.errors, "an error must be recorded"
    assert offending in parsed.content
    assert parsed.tool_calls == []
    _assert_stream_equals_whole(text, random.Random(0))


def test_malformed_invoke_does_not_hide_valid_neighbours() -> None:
    bad = _INV.format(_P.format("a", "false", "{oops"))
    good = _INV.format(_P.format("a", "false", "[1]"))
    parsed = parse_message(_BLOCK.format(bad + "\n" + good))
    assert parsed.content == bad and len(parsed.errors) == 1
    assert [(c.id, c.name, c.arguments) for c in parsed.tool_calls] == [
        ("call_0", "f", '{"a": [1]}')
    ]


def test_unterminated_block_keeps_complete_calls() -> None:
    text = encode_tool_calls(_calls([("f", {"a": 1})])).removesuffix("</｜DSML｜tool_calls>")
    parsed = parse_message(text)
    assert [c.name for c in parsed.tool_calls] == ["f"] and parsed.content == ""
    assert any("unterminated tool_calls block" in e for e in parsed.errors)
