"""Hostile schemas, regexes and grammars are 400s naming the field before the engine sees them,
never 500s (issue 29: each of the served cases below gave a 5xx before grammar_limits.py), and
the check's own cost is bounded by the limits (measured, printed with -s; not asserted)."""

from __future__ import annotations

import time

import httpx
import pytest

from kvrelay.server import grammar_limits as G
from kvrelay.server import structured as S
from kvrelay.server.errors import APIError

MODEL = "smollm2"
MSG = [{"role": "user", "content": "hi"}]
SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
EBNF_50K = "root ::= " + " | ".join(f'"w{i}"' for i in range(50_000))


def _chat_schema(schema: dict) -> dict:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return {"model": MODEL, "messages": MSG, "max_tokens": 4, "response_format": rf}


def _comp(**kw) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **kw}


# (id, path, body, the param the 400 must name)
SERVED = [
    (
        "integer-minimum-10^400",
        "/v1/chat/completions",
        _chat_schema({"type": "integer", "minimum": 10**400}),
        "response_format.minimum",
    ),
    ("self-required-ref", "/v1/completions", _comp(guided_json=SELF_REQUIRED), "guided_json"),
    (
        "format-and-pattern",
        "/v1/chat/completions",
        _chat_schema({"type": "string", "format": "date-time", "pattern": "^2.*$"}),
        "response_format",
    ),
    (
        "ebnf-50k-alternatives",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 4, "ebnf": EBNF_50K}},
        "sampling_params.ebnf",
    ),
    ("regex-over-16k", "/v1/completions", _comp(guided_regex="a" * 20_000), "guided_regex"),
    (
        "regex-nested-ranges",
        "/v1/completions",
        _comp(guided_regex="((a{1,30}){1,30}){1,30}"),
        "guided_regex",
    ),
    (
        "schema-pattern-nested-ranges",
        "/v1/chat/completions",
        _chat_schema({"type": "object", "properties": {"s": {"type": "string",
                      "pattern": "^(a{1,300}){1,300}$"}}}),
        "response_format.properties.s.pattern",
    ),
    (
        "tool-self-required-list",
        "/v1/chat/completions",
        {
            "model": MODEL, "messages": MSG, "max_tokens": 4, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"xs": {"type": "array", "minItems": 1,
                "items": {"$ref": "#"}}}, "required": ["xs"]}}}],
        },
        "tools[0].function.parameters",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"), [c[1:] for c in SERVED], ids=[c[0] for c in SERVED]
)
def test_hostile_schema_is_a_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_the_server_still_serves_after_them(server):
    r = httpx.post(server.url + "/v1/completions", json=_comp(guided_regex="(yes|no)"), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text


def _refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


def test_recursion_that_can_end_is_allowed_and_one_that_cannot_is_refused():
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    S.json_schema_grammar(tree, "p")  # a tree's leaves have no kids: fine
    linked = {
        "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
        "$ref": "#/$defs/n",
    }
    S.json_schema_grammar(linked, "p")  # `next` is optional: fine
    forced = {
        "$defs": {"n": {"properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
        "$ref": "#/$defs/n",
    }
    e = _refused(S.json_schema_grammar, forced, "p")
    assert "required 'next'" in e.message and "contain itself" in e.message
    via_all_of = {"allOf": [{"$ref": "#"}]}
    assert "allOf[0]" in _refused(S.json_schema_grammar, via_all_of, "p").message


def test_numbers_nesting_and_size_limits_name_the_keyword():
    assert _refused(G.check_schema, {"maximum": -(2**64)}, "p").param == "p.maximum"
    assert _refused(G.check_schema, {"enum": [1, float("inf")]}, "p").param == "p.enum[1]"
    deep: dict = {}
    node = deep
    for _ in range(G.MAX_SCHEMA_DEPTH + 1):
        node["items"] = {}
        node = node["items"]
    assert "nested deeper" in _refused(G.check_schema, deep, "p").message
    wide = {"enum": ["x" * 1000] * 300}
    assert "byte schema" in _refused(G.check_schema, wide, "p").message


def test_repetitions_are_bounded_alone_and_nested():
    """Nested ranges multiply in llguidance's lexer: ((a{1,30}){1,30}){1,30} (27000) failed on
    the engine's 6th token ("too many expressions constructed"), (a{1,10}b{1,10}){1,100} (1000)
    ran."""
    assert G.repetition_bounds("((a{1,30}){1,30}){1,30}") == (30, 27000)
    assert G.repetition_bounds("(a{1,10}b{1,10}){1,100}") == (100, 1000)
    assert G.repetition_bounds(r"(\d{3}-){2}\x{7b}{4}[{]{9}") == (9, 6)
    G.check_regex("(a{1,10}b{1,10}){1,100}", "p")
    assert "multiply to 27000" in _refused(G.check_regex, "((a{1,30}){1,30}){1,30}", "p").message
    assert "repetition of 100000" in _refused(G.check_regex, "a{100000}", "p").message
    grammar = 'root ::= "{(" ("a"{10}){200}'  # quoted text is skipped, GBNF ranges counted
    assert _refused(G.check_grammar_text, grammar, "p").param == "p"


def test_alternatives_are_counted_outside_literals():
    assert G.count_alternatives('r ::= "a|b" | [|] | /x|y/ | c # x|y\nq ::= a | b') == 4
    ok = "root ::= " + " | ".join(f'"w{i}"' for i in range(G.MAX_ALTERNATIVES + 1))
    S._ebnf_grammar(ok, "p")  # MAX_ALTERNATIVES bars: the most allowed
    spread = "root ::= " + " | ".join(f"r{j}" for j in range(20)) + "\n"
    spread += "\n".join(
        f"r{j} ::= " + " | ".join(f'"{j}x{i}"' for i in range(60)) for j in range(20)
    )
    e = _refused(S._ebnf_grammar, spread, "sampling_params.ebnf")  # 20 x 60 in one row
    assert e.param == "sampling_params.ebnf" and "alternatives" in e.message


def test_checking_at_the_limits_costs_little(capsys):
    """What a client can make the API spend on one check, at the limits (printed, not asserted:
    tests never assert on timing)."""
    alts = "root ::= " + " | ".join(f'"word{i:05d}"' for i in range(G.MAX_ALTERNATIVES))
    props = {
        f"p{i}": {"type": "object", "properties": {"a": {"type": "integer"}}} for i in range(3000)
    }
    cases = {
        "ebnf, 1000 alternatives": lambda: S._ebnf_grammar(alts, "p"),
        "ebnf, 64 KiB": lambda: S._ebnf_grammar("root ::= " + '"ab" ' * 13_000, "p"),
        "schema, 3000 properties": lambda: S.json_schema_grammar({"properties": props}, "p"),
        "regex, 16 KiB": lambda: S._regex_grammar("(" + "|".join(f"a{i}" for i in range(2700)) + ")", "p"),
    }  # fmt: skip
    for name, fn in cases.items():
        t0 = time.perf_counter()
        fn()
        with capsys.disabled():
            print(f"\n{name}: {time.perf_counter() - t0:.3f} s")
