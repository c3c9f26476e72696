"""JSON-style (Hermes) tool calls, parsed whole or streamed.

The format Qwen and SmolLM2-style templates teach their models:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call is released whole once its `</tool_call>` arrives, so a streamed parse equals the
whole parse for any split of the text (the same rule as the DSML parser). A call left open when
the output ends counts only if the model ended it (EOS, a stop): one cut off by max_tokens
(`finish(truncated=True)`) stays content, however complete its JSON looks. Whitespace around
a call is layout and is dropped. A call that is not a JSON object with a name and object
arguments stays content, with an entry in `errors`; the parser never raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvrelay.server.tools.dsml import (
    Delta,
    ToolCallDelta,
    add_content,
    partial_suffix_start,
)

START = "<tool_call>"
END = "</tool_call>"


def parse_call(body: str) -> tuple[str, str]:
    """(name, arguments JSON) of one call's body; ValueError with the reason if malformed."""
    try:
        obj: Any = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"tool call is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("tool call is not a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError("tool call without a name")
    # Llama-style templates say "parameters"; some models write the arguments as a string.
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ValueError("tool call arguments are a string but not JSON") from None
    if not isinstance(args, dict):
        raise ValueError("tool call arguments are not a JSON object")
    return name.strip(), json.dumps(args, ensure_ascii=False)


@dataclass
class JsonToolCallStreamParser:
    """Incremental parser of `<tool_call>{…}</tool_call>`: feed() pieces, then finish().

    Tool call ids are f"{id_prefix}{index}", so a given text always yields the same ids.
    """

    id_prefix: str = "call_"
    errors: list[str] = field(default_factory=list, init=False)
    _buf: str = field(default="", init=False)
    _in_call: bool = field(default=False, init=False)
    _after_call: bool = field(default=False, init=False)  # whitespace here is layout
    _gap: str = field(default="", init=False)  # whitespace dropped before the open call
    _calls: int = field(default=0, init=False)
    _out: list[Delta] = field(default_factory=list, init=False)
    _truncated: bool = field(default=False, init=False)

    def feed(self, piece: str) -> list[Delta]:
        self._buf += piece
        return self._drain(final=False)

    def finish(self, truncated: bool = False) -> list[Delta]:
        self._truncated = truncated
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Delta]:
        while self._step(final):
            pass
        out, self._out = self._out, []
        return out

    def _content(self, text: str) -> None:
        add_content(self._out, text)

    def _step(self, final: bool) -> bool:
        """Consume what can be decided now. Returns True when it made progress."""
        if self._in_call:
            return self._step_call(final)
        if self._after_call:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._after_call = False
        buf = self._buf
        start = buf.find(START)
        if start != -1:
            before = buf[:start]
            text = before.rstrip()
            self._content(text)
            self._gap = before[len(text) :]
            self._buf = buf[start + len(START) :]
            self._in_call = True
            return True
        if final:
            self._content(buf)
            self._buf = ""
            return False
        # Hold back a partial start tag, and trailing whitespace (a call may follow it).
        keep = len(buf[: partial_suffix_start(buf, (START,))].rstrip())
        self._content(buf[:keep])
        self._buf = buf[keep:]
        return False

    def _step_call(self, final: bool) -> bool:
        end = self._buf.find(END)
        if end == -1 and not final:
            return False
        # Lenient at the end of the output: a call cut off before its close tag still counts.
        body = self._buf if end == -1 else self._buf[:end]
        raw = START + body + ("" if end == -1 else END)
        self._buf = "" if end == -1 else self._buf[end + len(END) :]
        self._in_call = False
        if end == -1 and self._truncated:
            self.errors.append("tool call cut off by max_tokens (no </tool_call>)")
            self._content(self._gap + raw)
            return True
        try:
            name, arguments = parse_call(body)
        except ValueError as e:
            self.errors.append(str(e))
            self._content(self._gap + raw)
            return True
        index = self._calls
        self._calls += 1
        self._out.append(ToolCallDelta(index, f"{self.id_prefix}{index}", name, arguments))
        self._after_call = True
        return True
