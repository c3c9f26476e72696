"""DeepSeek-V4 DSML tool calls: encode them, and parse them whole or streamed.

The format (reference/deepseek-v4.md §8; vLLM `deepseek_v4_encoding.py`, a port of the
official encoding_dsv4) is what an assistant turn carries after its content:

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">杭州</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">5</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

String values are written raw (string="true"); every other value is JSON (string="false").
Raw strings are not escaped, so a value that contains the DSML marker cannot round-trip.

Parsing is one state machine used both ways (`parse_message` feeds the whole text to a
`DsmlStreamParser`), so a streamed parse equals the whole parse for any split of the text.
A tool call is released whole once its `</｜DSML｜invoke>` arrives: a later malformation
must still be able to turn the invoke back into content, which a call already streamed
in fragments could not. Malformed DSML never raises; it comes back as content plus an
entry in `errors`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

DSML = "｜DSML｜"
# The template joins content and the tool block with a blank line; the parser strips it.
SEPARATOR = "\n\n"
# tool_calls is what V4 emits; the rest are accepted on input only (reference §8: vLLM
# also accepts toolcalls and tool; function_calls is the V3.2 name).
BLOCK_NAMES = ("tool_calls", "toolcalls", "tool", "function_calls")
BLOCK_STARTS = tuple(f"<{DSML}{n}>" for n in BLOCK_NAMES)
BLOCK_ENDS = tuple(f"</{DSML}{n}>" for n in BLOCK_NAMES)
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_CLOSE = f"</{DSML}parameter>"

_INVOKE_TAG = re.compile(rf'<{DSML}invoke\s+name="([^"]*)"\s*>')
_PARAM_TAG = re.compile(rf'<{DSML}parameter\s+name="([^"]*)"(?:\s+string="([^"]*)")?\s*>')
# Markers whose beginning must be held back in plain text until it is clearly not one.
_TEXT_MARKERS = (*BLOCK_STARTS, *(SEPARATOR + s for s in BLOCK_STARTS), DSML)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as in OpenAI's function.arguments


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    content: str
    tool_calls: list[ToolCall]
    errors: list[str]


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


def add_content(out: list, text: str) -> None:
    """Append `text` to a stream parser's pending deltas, merged into a trailing ContentDelta."""
    if not text:
        return
    if out and isinstance(out[-1], ContentDelta):
        out[-1] = ContentDelta(out[-1].text + text)
    else:
        out.append(ContentDelta(text))


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One entry of OpenAI's streaming `choices[0].delta.tool_calls`.

    id and name are set on the first delta of a call; arguments fragments concatenate.
    This parser sends each call as a single delta carrying all three.
    """

    index: int
    id: str | None
    name: str | None
    arguments: str


Delta = ContentDelta | ToolCallDelta


class DsmlError(ValueError):
    """A tool call that cannot be written as DSML."""


# ---------------------------------------------------------------------------- encode


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _arguments_dict(arguments: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    if not arguments.strip():  # clients send "" for calls without arguments
        return {}
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise DsmlError(f"tool call arguments are not JSON: {e}") from None
    if not isinstance(value, dict):
        raise DsmlError("tool call arguments must be a JSON object")
    return value


def encode_invoke(name: str, arguments: str | dict[str, Any]) -> str:
    params = [
        f'<{DSML}parameter name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
        f"{v if isinstance(v, str) else _json(v)}{PARAM_CLOSE}"
        for key, v in _arguments_dict(arguments).items()
    ]
    # An invoke without parameters still has the empty line (the template joins "").
    return f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}"


def encode_tool_calls(calls: list[ToolCall]) -> str:
    """The text that follows an assistant turn's content: separator + tool block ("" if none)."""
    if not calls:
        return ""
    invokes = "\n".join(encode_invoke(c.name, c.arguments) for c in calls)
    return f"{SEPARATOR}<{DSML}tool_calls>\n{invokes}\n</{DSML}tool_calls>"


# ----------------------------------------------------------------------------- parse


def partial_suffix_start(buf: str, markers: tuple[str, ...]) -> int:
    """Start of the longest suffix of buf that is a proper prefix of a marker (len if none)."""
    best = len(buf)
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), 0, -1):
            if buf.endswith(m[:k]):
                best = min(best, len(buf) - k)
                break
    return best


def _is_proper_prefix(s: str, markers: tuple[str, ...]) -> bool:
    return any(len(s) < len(m) and m.startswith(s) for m in markers)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite_float(s: str) -> float:
    value = float(s)
    if not math.isfinite(value):
        raise ValueError(f"{s} overflows a float")
    return value


def _parse_json_value(raw: str) -> Any:
    return json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)


def parse_invoke(unit: str) -> tuple[str, str]:
    """Parse one complete `<｜DSML｜invoke …>…</｜DSML｜invoke>` into (name, arguments JSON).

    Raises ValueError with the reason when the invoke is malformed.
    """
    m = _INVOKE_TAG.match(unit)
    if m is None:
        raise ValueError("malformed invoke tag")
    name = m.group(1).strip()
    if not name:
        raise ValueError("invoke without a tool name")
    end = len(unit) - len(INVOKE_CLOSE)
    args: dict[str, Any] = {}
    pos = m.end()
    while True:
        while pos < end and unit[pos].isspace():
            pos += 1
        if pos >= end:
            break
        p = _PARAM_TAG.match(unit, pos, end)
        if p is None:
            raise ValueError(f"unexpected text in invoke {name!r}")
        key, string = p.group(1), p.group(2)
        value_end = unit.find(PARAM_CLOSE, p.end(), end)
        if value_end == -1:
            raise ValueError(f"unterminated parameter {key!r}")
        raw = unit[p.end() : value_end]
        if not key:
            raise ValueError("parameter without a name")
        if key in args:
            raise ValueError(f"duplicate parameter {key!r}")
        if DSML in raw:
            raise ValueError(f"DSML marker inside the value of parameter {key!r}")
        if string == "true":
            args[key] = raw
        elif string == "false":
            try:
                args[key] = _parse_json_value(raw)
            except ValueError as e:
                raise ValueError(f"parameter {key!r} is string=false but not JSON: {e}") from None
        elif string is None:
            # Lenient like vLLM's parser (reference §8): JSON when it parses, else the raw text.
            try:
                args[key] = _parse_json_value(raw)
            except ValueError:
                args[key] = raw
        else:
            raise ValueError(f"parameter {key!r} has string={string!r}")
        pos = value_end + len(PARAM_CLOSE)
    return name, _json(args)


@dataclass
class DsmlStreamParser:
    """Incremental DSML parser: feed() text pieces, then finish().

    Text that might begin a DSML marker is held back until it is clearly content.
    Tool call ids are f"{id_prefix}{index}", so a given text always yields the same ids.
    """

    id_prefix: str = "call_"
    errors: list[str] = field(default_factory=list, init=False)
    _buf: str = field(default="", init=False)
    _offset: int = field(default=0, init=False)  # where _buf starts in the whole text
    _in_block: bool = field(default=False, init=False)
    _calls: int = field(default=0, init=False)
    _out: list[Delta] = field(default_factory=list, init=False)

    def feed(self, piece: str) -> list[Delta]:
        self._buf += piece
        return self._drain(final=False)

    def finish(self, truncated: bool = False) -> list[Delta]:
        """`truncated` changes nothing here: only a closed invoke is ever a call."""
        out = self._drain(final=True)
        if self._in_block:
            self._error("unterminated tool_calls block")
            self._in_block = False
        return out

    # -- internals

    def _drain(self, final: bool) -> list[Delta]:
        while self._step_block(final) if self._in_block else self._step_text(final):
            pass
        out, self._out = self._out, []
        return out

    def _error(self, what: str, at: int | None = None) -> None:
        self.errors.append(f"{what} (at offset {self._offset if at is None else at})")

    def _consume(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._offset += n
        return taken

    def _content(self, text: str) -> None:
        add_content(self._out, text)

    def _step_text(self, final: bool) -> bool:
        """Plain content: look for a block start. Returns True when it made progress."""
        buf = self._buf
        starts = [(p, s) for s in BLOCK_STARTS if (p := buf.find(s)) != -1]
        start = min(starts, default=None)
        q = buf.find(DSML)
        if start is not None and q == start[0] + 1:
            p, s = start
            before = buf[:p]
            self._content(before.removesuffix(SEPARATOR))
            self._consume(p + len(s))
            self._in_block = True
            return True
        if q != -1:
            # A marker that may still grow into a block start waits for more text.
            if not final and q > 0 and _is_proper_prefix(buf[q - 1 :], BLOCK_STARTS):
                self._content(self._consume(partial_suffix_start(buf, _TEXT_MARKERS)))
                return False
            self._error("DSML marker outside a tool_calls block", self._offset + q)
            self._content(self._consume(q + len(DSML)))
            return True
        keep = len(buf) if final else partial_suffix_start(buf, _TEXT_MARKERS)
        self._content(self._consume(keep))
        return False

    def _step_block(self, final: bool) -> bool:
        """Inside a tool_calls block: take one whole unit. Returns True when it made progress."""
        ws = len(self._buf) - len(self._buf.lstrip())
        self._consume(ws)  # whitespace between tags is layout
        buf = self._buf
        if not buf:
            return False
        if buf.startswith(INVOKE_OPEN):
            return self._step_invoke(final)
        for end in BLOCK_ENDS:
            if buf.startswith(end):
                self._consume(len(end))
                self._in_block = False
                return True
        if not final and _is_proper_prefix(buf, (*BLOCK_ENDS, INVOKE_OPEN)):
            return False
        # Anything else (stray text, unknown or misplaced tags) runs to the next tag.
        nxt = [p for t in (f"<{DSML}", f"</{DSML}") if (p := buf.find(t, 1)) != -1]
        if not nxt and not final:
            return False
        unit = self._consume(min(nxt) if nxt else len(buf))
        what = "unexpected DSML tag" if DSML in unit[: 3 + len(DSML)] else "unexpected text"
        self._error(f"{what} in tool_calls block", self._offset - len(unit))
        self._content(unit)
        return True

    def _step_invoke(self, final: bool) -> bool:
        buf = self._buf
        # The invoke ends at the first DSML tag that is not a parameter tag.
        q = buf.find(DSML, len(INVOKE_OPEN))
        while q != -1:
            rest = buf[q + len(DSML) :]
            if rest.startswith("parameter"):
                q = buf.find(DSML, q + len(DSML))
                continue
            if "parameter".startswith(rest):  # a tag cut off by the end of the text so far
                if not final:
                    return False
                q = -1
            break
        if q == -1:
            if not final:
                return False
            return self._bad_invoke(len(buf), "unterminated invoke")
        tag = q - 2 if buf[q - 2 : q] == "</" else q - 1 if buf[q - 1] == "<" else q
        if buf.startswith(INVOKE_CLOSE, tag):
            unit_len = tag + len(INVOKE_CLOSE)
            try:
                name, arguments = parse_invoke(buf[:unit_len])
            except ValueError as e:
                return self._bad_invoke(unit_len, str(e))
            self._consume(unit_len)
            index = self._calls
            self._calls += 1
            self._out.append(ToolCallDelta(index, f"{self.id_prefix}{index}", name, arguments))
            return True
        if INVOKE_CLOSE.startswith(buf[tag:]):  # the close tag cut off by the end so far
            return False if not final else self._bad_invoke(len(buf), "unterminated invoke")
        return self._bad_invoke(tag, "unterminated invoke")

    def _bad_invoke(self, n: int, why: str) -> bool:
        self._error(why)
        self._content(self._consume(n))
        return True


def assemble(deltas: list[Delta]) -> tuple[str, list[ToolCall]]:
    """Fold deltas into (content, tool calls), as an OpenAI client does with a stream."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, ContentDelta):
            content.append(d.text)
            continue
        slot = calls.setdefault(d.index, ["", "", ""])
        slot[0] = d.id if d.id is not None else slot[0]
        slot[1] = d.name if d.name is not None else slot[1]
        slot[2] += d.arguments
    return "".join(content), [ToolCall(*calls[i]) for i in sorted(calls)]


def parse_message(text: str, id_prefix: str = "call_") -> ParsedMessage:
    """Split a whole assistant message (without EOS) into content and tool calls."""
    parser = DsmlStreamParser(id_prefix=id_prefix)
    content, calls = assemble(parser.feed(text) + parser.finish())
    return ParsedMessage(content, calls, parser.errors)
