"""DeepSeek-V4 prompt encoding from OpenAI-format messages, and the reasoning split of its output.

Follows reference/deepseek-v4.md §8, whose source is vLLM's `deepseek_v4_encoding.py` (a port
of the official encoding_dsv4); details the reference leaves out are taken from that file and
marked "(vLLM)". Choices of our own are marked "Our choice".

    BOS + [Reasoning-Effort preamble] + system + "\\n\\n" + tools section
      + <｜User｜>user + <｜Assistant｜> + (<think> | </think>)
      + [reasoning + </think>] + content + "\\n\\n" + DSML tool block + <｜end▁of▁sentence｜>
      + <｜User｜><tool_result>r1</tool_result>\\n\\n<tool_result>r2</tool_result> + ...
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvrelay.server.tools.dsml import (
    BLOCK_STARTS,
    SEPARATOR,
    DsmlError,
    ToolCall,
    encode_tool_calls,
    partial_suffix_start,
)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

# (vLLM) Prepended to the first message in thinking mode when reasoning_effort == "max".
# The reference mentions a preamble for "high" too, but the source has text for "max" only.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)

# (vLLM) The tools section, appended to the system prompt after a blank line.
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. \
You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. \
For all other types (numbers, booleans, arrays, objects), \
pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), \
you MUST output your complete reasoning inside <think>...</think> \
BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{tool_schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class ChatEncodingError(ValueError):
    """The messages cannot be encoded (the API answers 400)."""


@dataclass
class _Msg:
    role: str  # system | developer | user | assistant (tool messages are folded into user)
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    # user turns: ("text", text, "") or ("tool_result", text, tool_call_id)
    blocks: list[tuple[str, str, str]] = field(default_factory=list)


def render_tools(tools: list[dict[str, Any]]) -> str:
    # (vLLM) One compact JSON object per line, non-ASCII kept; OpenAI's {"type": "function",
    # "function": {...}} wrapper is removed. Our choice: a bare function dict is accepted too.
    schemas = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return TOOLS_TEMPLATE.replace("{tool_schemas}", schemas)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # Our choice: OpenAI content parts are joined with "\n", as vLLM's front end flattens
        # them before the encoder sees a string; non-text parts cannot be encoded.
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ChatEncodingError("only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "\n".join(parts)
    raise ChatEncodingError(f"unsupported message content of type {type(content).__name__}")


def _tool_calls(raw: Any) -> list[ToolCall]:
    calls = []
    for tc in raw or []:
        fn = tc.get("function") or {}
        args = fn.get("arguments", "")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        if not fn.get("name"):
            raise ChatEncodingError("assistant tool call without a function name")
        calls.append(ToolCall(tc.get("id") or "", fn["name"], args or ""))
    return calls


def _fold(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[_Msg]:
    """OpenAI messages → internal turns: tool results and consecutive users merged (vLLM)."""
    out: list[_Msg] = []
    for m in messages:
        role = m.get("role")
        if role in ("tool", "user"):
            kind = "tool_result" if role == "tool" else "text"
            # Our choice: content None is "" (vLLM's encoder would print "None").
            block = (kind, _text(m.get("content")), str(m.get("tool_call_id") or ""))
            if out and out[-1].role == "user":
                out[-1].blocks.append(block)
            else:
                out.append(_Msg("user", blocks=[block]))
        elif role in ("system", "developer"):
            out.append(_Msg(role, _text(m.get("content"))))
        elif role == "assistant":
            # DeepSeek's API names it reasoning_content; vLLM's encoder reads reasoning.
            reasoning = _text(m.get("reasoning_content") or m.get("reasoning"))
            out.append(
                _Msg(role, _text(m.get("content")), reasoning, _tool_calls(m.get("tool_calls")))
            )
        else:
            raise ChatEncodingError(f"unknown message role {role!r}")
    if tools:
        # (vLLM) Request tools go on a leading system/developer message, else on a new empty one.
        if not (out and out[0].role in ("system", "developer")):
            out.insert(0, _Msg("system"))
        out[0].tools = tools
    return out


def _sort_tool_results(msgs: list[_Msg]) -> None:
    """(vLLM) Order each turn's tool results by the previous assistant's call order."""
    order: dict[str, int] = {}
    for m in msgs:
        if m.role == "assistant" and m.tool_calls:
            order = {tc.id: i for i, tc in enumerate(m.tool_calls) if tc.id}
        elif m.role == "user" and order:
            results = sorted(
                (b for b in m.blocks if b[0] == "tool_result"), key=lambda b: order.get(b[2], 0)
            )
            it = iter(results)
            m.blocks = [next(it) if b[0] == "tool_result" else b for b in m.blocks]


def _last_user(msgs: list[_Msg]) -> int:
    return max((i for i, m in enumerate(msgs) if m.role in ("user", "developer")), default=-1)


def encode_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    thinking: bool = False,
    add_generation_prompt: bool = True,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
) -> str:
    """Encode an OpenAI-format conversation as a DeepSeek-V4 prompt string.

    thinking: the generation prompt ends with <think> (thinking mode) or </think> (chat mode).
    drop_thinking: earlier turns' reasoning is dropped (reference §8); never when tools are given.
    add_generation_prompt: False leaves off the <｜Assistant｜><think>|</think> after a final
    user turn (our choice; the reference always adds it).
    """
    msgs = _fold(messages, tools)
    _sort_tool_results(msgs)
    drop = drop_thinking and not tools
    if thinking and drop:
        # (vLLM) Before the last user turn: developer turns go, assistants lose their reasoning.
        last = _last_user(msgs)
        msgs = [m for i, m in enumerate(msgs) if i >= last or m.role != "developer"]
    last = _last_user(msgs)

    out = [BOS]
    if thinking and reasoning_effort == "max":
        out.append(REASONING_EFFORT_MAX)
    for i, m in enumerate(msgs):
        tools_part = SEPARATOR + render_tools(m.tools) if m.tools else ""
        if m.role == "system":
            out.append(m.content + tools_part)
        elif m.role == "developer":
            out.append(USER + m.content + tools_part)
        elif m.role == "user":
            out.append(USER + "\n\n".join(_block(b) for b in m.blocks))
        else:
            keep = thinking and (not drop or i > last)
            try:
                calls = encode_tool_calls(m.tool_calls)
            except DsmlError as e:
                raise ChatEncodingError(str(e)) from None
            out.append((m.reasoning + THINK_END if keep else "") + m.content + calls + EOS)
        # (vLLM) A user turn hands over to the assistant when one follows or it is the last turn.
        nxt = msgs[i + 1].role if i + 1 < len(msgs) else None
        if m.role in ("user", "developer") and nxt in ("assistant", None):
            if nxt is None and not add_generation_prompt:
                continue
            think = thinking and (not drop or i >= last)
            out.append(ASSISTANT + (THINK_START if think else THINK_END))
    return "".join(out)


def _block(block: tuple[str, str, str]) -> str:
    kind, text, _ = block
    return f"<tool_result>{text}</tool_result>" if kind == "tool_result" else text


# ------------------------------------------------------------------- thinking output

_REASONING_ENDS = (THINK_END, *BLOCK_STARTS, *(SEPARATOR + s for s in BLOCK_STARTS))


@dataclass
class ReasoningStreamSplitter:
    """Split thinking-mode output (the prompt ended with <think>) into reasoning and content.

    Reasoning ends at </think>. Our choice, as vLLM's parser does: a tool_calls block that
    starts before any </think> also ends the reasoning, and belongs to the content.
    A leading <think> the model repeats is dropped.
    """

    _buf: str = field(default="", init=False)
    _state: str = field(default="start", init=False)  # start | reasoning | content

    def feed(self, piece: str) -> tuple[str, str]:
        self._buf += piece
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        if self._state == "start":
            if not final and THINK_START.startswith(self._buf) and self._buf != THINK_START:
                return "", ""
            self._buf = self._buf.removeprefix(THINK_START)
            self._state = "reasoning"
        if self._state == "content":
            out, self._buf = self._buf, ""
            return "", out
        buf = self._buf
        hits = [(p, e) for e in _REASONING_ENDS if (p := buf.find(e)) != -1]
        if not hits:
            keep = len(buf) if final else partial_suffix_start(buf, _REASONING_ENDS)
            self._buf = buf[keep:]
            return buf[:keep], ""
        p, end = min(hits)
        self._state, self._buf = "content", ""
        if end == THINK_END:
            return buf[:p], buf[p + len(end) :]
        return buf[:p], buf[p:]  # the block (with its separator) is content for the DSML parser


def reasoning_split(text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole thinking-mode completion."""
    s = ReasoningStreamSplitter()
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2
