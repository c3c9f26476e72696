"""Grammars (llguidance Lark) that force a model to call tools in its own tool-call format.

Used for `tool_choice: "required"` and a named function. Each grammar produces exactly the text
the format's parser (json_calls.py, dsml.py) turns into tool calls, with arguments valid for the
function's JSON schema:

- JSON-style (Hermes) calls: `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`, the
  object constrained by a JSON schema whose `name` is the function's and whose `arguments` is the
  function's `parameters`.
- DeepSeek-V4 DSML: the tool_calls block with one invoke per call; string-typed parameters are
  raw text (string="true", which may not contain the DSML marker), every other parameter is
  JSON for its schema (string="false"). Parameters come in the schema's order; required ones
  always, optional ones may be left out.

JSON is compact (", " and ": " separators, no other whitespace): a small model cannot pad the
output with newlines forever.
"""

from __future__ import annotations

import json
from typing import Any

from kvrelay.server.tools.dsml import DSML, PARAM_CLOSE

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def _lit(s: str) -> str:
    """A Lark string literal."""
    return json.dumps(s, ensure_ascii=False)


def _regex_escape(s: str) -> str:
    return "".join("\\" + c if c in "\\/.^$*+?()[]{}|-" else c for c in s)


# DSML raw string values: any text up to the parameter's close tag, with no other DSML marker.
_DSML_STR = (
    f"DSML_STR: /(?s:.*){_regex_escape(PARAM_CLOSE)}/ "
    f"& ~/(?s:.*){_regex_escape(DSML)}(?s:.*){_regex_escape(DSML)}(?s:.*)/"
)


def with_options(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with kvrelay's JSON layout (llguidance's x-guidance options)."""
    return {**schema, "x-guidance": JSON_OPTIONS}


def _json_rule(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(with_options(schema), ensure_ascii=False)


def parameters(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return params if params else NO_ARGUMENTS


def _calls(call: str, parallel: bool) -> str:
    return f'{call} ("\\n" {call})*' if parallel else call


def json_calls_grammar(functions: list[dict[str, Any]], parallel: bool) -> str:
    """Lark for one (or, parallel, several) `<tool_call>` blocks calling these functions."""
    alternatives = [
        {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": parameters(fn)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for fn in functions
    ]
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return "\n".join(
        [
            f"start: {_calls('call', parallel)}",
            f'call: "<tool_call>\\n" {_json_rule(schema)} "\\n</tool_call>"',
        ]
    )


def _is_plain_string(schema: Any) -> bool:
    """A string parameter the DSML encoder writes raw: type string, no other constraint."""
    if not isinstance(schema, dict) or schema.get("type") != "string":
        return False
    return set(schema) <= {"type", "description", "title", "examples"}


def _string_choices(schema: Any) -> list[str] | None:
    """The values of a parameter that can only be one of some strings (enum / const), which
    the encoder writes raw; None otherwise."""
    if not isinstance(schema, dict) or schema.get("type", "string") != "string":
        return None
    values = (
        schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    )
    if not values or not all(isinstance(v, str) and DSML not in v for v in values):
        return None
    return values


def _dsml_param(rule: str, name: str, schema: Any) -> str:
    head = f'<{DSML}parameter name="{name}" string='
    raw, as_json = _lit(head + '"true">'), _lit(head + '"false">')
    if _is_plain_string(schema):
        return f"{rule}: {raw} DSML_STR"
    choices = _string_choices(schema)
    if choices is not None:
        return f"{rule}: {raw} ({' | '.join(map(_lit, choices))}) {_lit(PARAM_CLOSE)}"
    value = schema if isinstance(schema, dict) else {}
    return f"{rule}: {as_json} {_json_rule(value)} {_lit(PARAM_CLOSE)}"


def dsml_calls_grammar(
    functions: list[dict[str, Any]], parallel: bool, think_end: str | None = None
) -> str:
    """Lark for a DSML tool_calls block calling these functions. think_end: in thinking mode,
    how the reasoning before the block ends (a Lark item: the `</think>` token).

    Every newline is a literal of its own: a literal that is a prefix of another one
    ("\n" and "\n</…>") would make llguidance's greedy lexer take the longer and fail."""
    lines = []
    invokes = []
    for i, fn in enumerate(functions):
        params = parameters(fn)
        props = dict(params.get("properties") or {})
        required = params.get("required") or []
        for key in required:  # required but undeclared: any JSON value
            props.setdefault(key, {})
        body = []
        for j, (key, schema) in enumerate(props.items()):
            rule = f"p{i}_{j}"
            lines.append(_dsml_param(rule, key, schema))
            body.append(f"NL {rule}" if key in required else f"(NL {rule})?")
        head = _lit(f'<{DSML}invoke name="{fn["name"]}">')
        inner = " ".join(body) if body else "NL"  # no parameters: the encoder's empty line
        lines.append(f"invoke{i}: {head} {inner} NL {_lit(f'</{DSML}invoke>')}")
        invokes.append(f"invoke{i}")
    calls = "invoke (NL invoke)*" if parallel else "invoke"
    block = f"NL NL {_lit(f'<{DSML}tool_calls>')} NL {calls} NL {_lit(f'</{DSML}tool_calls>')}"
    start = f"start: REASONING {think_end} {block}" if think_end else f"start: {block}"
    head = [start, "invoke: " + " | ".join(invokes), 'NL: "\\n"']
    if think_end:
        head.append("REASONING: /(?s:.*)/")
    return "\n".join([*head, *lines, _DSML_STR])
