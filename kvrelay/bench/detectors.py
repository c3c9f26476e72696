"""Cheap detectors of damaged model output, used by `kvrelay repro` on every reply.

Each detector looks at one reply alone: tool calls that do not parse (JSON-style `<tool_call>` or
DeepSeek DSML), arguments that break the tool's JSON schema, unbalanced think/tool tags, special
tokens leaked into the text, and repeated n-gram loops. They are weaker than a reference run (a
small model loops and fumbles tool syntax on its own), which is why repro counts a finding as
corruption only when the reference reply to the same request does not have it.

The parsers are the server's own (kvrelay/server/tools): pure functions, reused so that the client
and the server agree on what a well-formed call is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.server.tools import dsml, json_calls

DETECTORS = ("tool_parse", "tool_schema", "tag_balance", "special_token", "ngram_loop")

# Pairs of tags that must balance. DSML invoke/parameter open tags carry attributes, so their
# open marker is a prefix.
TAG_PAIRS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    (json_calls.START, json_calls.END),
    *zip(dsml.BLOCK_STARTS, dsml.BLOCK_ENDS, strict=True),
    (dsml.INVOKE_OPEN, dsml.INVOKE_CLOSE),
    (f"<{dsml.DSML}parameter", dsml.PARAM_CLOSE),
)
_TAG_RE = re.compile("|".join(re.escape(t) for pair in TAG_PAIRS for t in pair))
_OPENS = {o: i for i, (o, _) in enumerate(TAG_PAIRS)}
_CLOSES = {c: i for i, (_, c) in enumerate(TAG_PAIRS)}

# ChatML/Llama-3 style `<|im_start|>` and DeepSeek's full-width `<｜end▁of▁sentence｜>`. DSML tags
# (`<｜DSML｜invoke …>`) do not match: the bar is followed by a name, not by `>`.
SPECIAL_TOKEN_RE = re.compile(r"<\|[A-Za-z0-9_]{1,40}\|>|<｜[^｜<>\n]{1,40}｜>")


@dataclass(frozen=True)
class Finding:
    detector: str  # one of DETECTORS
    detail: str


@dataclass
class Reply:
    """What the client saw of one chat completion."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI format, as the server sent them
    tokens: list[str] = field(default_factory=list)  # logprobs token strings, when requested
    finish_reason: str | None = None

    @property
    def truncated(self) -> bool:
        """Cut off by max_tokens: a tag or call open at the end is not a defect then."""
        return self.finish_reason == "length"


# --- tool calls -------------------------------------------------------------------------------------


def parse_text_calls(text: str) -> tuple[list[dict], list[str]]:
    """Tool calls written in the text (JSON-style, then DSML), in OpenAI format, and parse errors.

    A server that parses calls takes the good ones out of the content; what stays there is either
    plain text or a call it could not parse. A server that does not parse leaves them all here.
    """
    jp = json_calls.JsonToolCallStreamParser()
    content, calls = dsml.assemble(jp.feed(text) + jp.finish())
    parsed = dsml.parse_message(content)
    out = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in [*calls, *parsed.tool_calls]
    ]
    return out, [*jp.errors, *parsed.errors]


def cut_unfinished(text: str) -> str:
    """The text without a tag that was opened and never closed at its end (max_tokens cut it)."""
    cut = len(text)
    for open_tag, close_tag in TAG_PAIRS:
        o = text.rfind(open_tag)
        if o != -1 and text.rfind(close_tag) < o:
            cut = min(cut, o)
    return text[:cut]


def _json_type_ok(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    expected = {
        "string": str,
        "boolean": bool,
        "object": dict,
        "array": list,
        "null": type(None),
    }.get(kind)
    return expected is None or isinstance(value, expected)  # unknown kinds are not checked


def schema_violations(arguments: str, schema: dict) -> list[str]:
    """What is wrong with a call's arguments (JSON text) against its tool's parameter schema:
    required keys, types, enums, numeric bounds, and unknown keys when additionalProperties is
    false. The subset of JSON Schema that tool definitions use."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as e:
        return [f"arguments are not JSON: {e}"]
    if not isinstance(args, dict):
        return ["arguments are not a JSON object"]
    props: dict = schema.get("properties") or {}
    errors = [f"missing required {k!r}" for k in schema.get("required") or [] if k not in args]
    for key, value in args.items():
        spec = props.get(key)
        if spec is None:
            if schema.get("additionalProperties") is False:
                errors.append(f"unknown argument {key!r}")
            continue
        kinds = spec.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds or []
        if kinds and not any(_json_type_ok(value, k) for k in kinds):
            errors.append(f"{key!r} should be {'|'.join(kinds)}, got {type(value).__name__}")
            continue
        if "enum" in spec and value not in spec["enum"]:
            errors.append(f"{key!r} = {value!r} is not one of {spec['enum']}")
        if isinstance(value, int | float) and not isinstance(value, bool):
            if "minimum" in spec and value < spec["minimum"]:
                errors.append(f"{key!r} = {value} is below {spec['minimum']}")
            if "maximum" in spec and value > spec["maximum"]:
                errors.append(f"{key!r} = {value} is above {spec['maximum']}")
    return errors


def tools_by_name(tools: Iterable[dict]) -> dict[str, dict]:
    """name -> parameter schema, from OpenAI `tools` definitions."""
    out = {}
    for t in tools:
        fn = t.get("function") or {}
        if fn.get("name"):
            out[fn["name"]] = fn.get("parameters") or {}
    return out


def check_call(call: dict, schemas: dict[str, dict]) -> list[str]:
    fn = call.get("function") or {}
    name = fn.get("name")
    if name not in schemas:
        return [f"unknown tool {name!r}"]
    arguments = fn.get("arguments")
    if isinstance(arguments, dict):  # some servers send the object itself
        arguments = json.dumps(arguments)
    return [f"{name}: {e}" for e in schema_violations(arguments or "", schemas[name])]


# --- text -------------------------------------------------------------------------------------------


def tag_imbalance(text: str, truncated: bool = False) -> list[str]:
    """Closes without opens, opens nested in themselves, and opens left unclosed.

    A first `</think>` without an open is accepted: thinking templates end the prompt with
    `<think>`, so the reply starts inside the block. Unclosed tags are accepted when the reply was
    cut off by max_tokens.
    """
    depth = [0] * len(TAG_PAIRS)
    think_closed_once = False
    errors = []
    for m in _TAG_RE.finditer(text):
        tag = m.group()
        if tag in _CLOSES:
            i = _CLOSES[tag]
            if depth[i] > 0:
                depth[i] -= 1
            elif i == 0 and not think_closed_once:
                pass  # the template opened the think block
            else:
                errors.append(f"{tag} without an open tag at offset {m.start()}")
            think_closed_once |= i == 0
        else:
            i = _OPENS[tag]
            if depth[i] > 0:
                errors.append(f"{tag} opened inside itself at offset {m.start()}")
            depth[i] += 1
    if not truncated:
        errors += [f"{TAG_PAIRS[i][0]} never closed" for i, d in enumerate(depth) if d > 0]
    return errors


def leaked_special_tokens(text: str, tokens: list[str], stopped: bool) -> list[str]:
    """Special-token strings in the visible text, or emitted as tokens before the end.

    The last token of a reply that stopped is its stop token (EOS), which is not a leak.
    """
    found = SPECIAL_TOKEN_RE.findall(text)
    body = tokens[:-1] if stopped else tokens
    found += [t for t in body if SPECIAL_TOKEN_RE.fullmatch(t.strip())]
    return sorted(set(found))


def ngram_loop(
    seq: list[str], max_period: int = 16, min_span: int = 16, min_repeats: int = 3
) -> str | None:
    """The first verbatim loop: a unit of 1..max_period items repeated back to back at least
    min_repeats times over at least min_span items. Units of whitespace alone (indentation,
    blank lines) do not count."""
    for period in range(1, max_period + 1):
        run = 0  # consecutive i with seq[i] == seq[i - period]
        for i in range(period, len(seq)):
            run = run + 1 if seq[i] == seq[i - period] else 0
            span = run + period
            if span >= min_span and span // period >= min_repeats:
                unit = seq[i - period + 1 : i + 1]
                if "".join(unit).strip():
                    return f"{''.join(unit)!r} x{span // period} ending at item {i}"
    return None


# --- all of them ------------------------------------------------------------------------------------


def detect(reply: Reply, schemas: dict[str, dict], ignore_eos: bool = False) -> list[Finding]:
    """Every finding on one reply; schemas from tools_by_name. With ignore_eos the model was made
    to write past its stop tokens, so special tokens among its tokens are expected."""
    text = reply.reasoning + reply.content
    findings: list[Finding] = []
    checked = cut_unfinished(reply.content) if reply.truncated else reply.content
    text_calls, parse_errors = parse_text_calls(checked)
    findings += [Finding("tool_parse", e) for e in parse_errors]
    for call in [*reply.tool_calls, *text_calls]:
        findings += [Finding("tool_schema", e) for e in check_call(call, schemas)]
    findings += [Finding("tag_balance", e) for e in tag_imbalance(text, reply.truncated)]
    stopped = reply.finish_reason in ("stop", "tool_calls")
    findings += [
        Finding("special_token", t)
        for t in leaked_special_tokens(text, [] if ignore_eos else reply.tokens, stopped)
    ]
    loop = ngram_loop(reply.tokens or re.findall(r"\S+", text))
    if loop:
        findings.append(Finding("ngram_loop", loop))
    return findings
