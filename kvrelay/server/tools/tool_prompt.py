"""Tools for chat templates that cannot render them (SmolLM2's drops `tools` without a word).

Whether a template renders tools is found by rendering a probe conversation with and without a
tool and comparing. Where it does not, the tool signatures and the JSON call format that
json_calls.py parses go into the system prompt instead, and earlier calls in the history are
written out in that same format (such a template drops `tool_calls` too)."""

from __future__ import annotations

import json
from typing import Any

_PROBE_MESSAGES = [{"role": "user", "content": "probe"}]
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "kvrelay_probe",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}
_PROBE_CALL = {
    "id": "call_0",
    "type": "function",
    "function": {"name": "kvrelay_probe", "arguments": {}},
}


def _render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str | None:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
    except Exception:  # a template that raises on tools says so itself, at request time
        return None


def renders_tools(tokenizer) -> bool:
    """False when the template's output is the same with a tool as without."""
    if not getattr(tokenizer, "chat_template", None):
        return True  # no template at all: the chat route refuses the request anyway
    plain = _render(tokenizer, _PROBE_MESSAGES)
    with_tool = _render(tokenizer, _PROBE_MESSAGES, [_PROBE_TOOL])
    return plain is None or with_tool is None or plain != with_tool


def renders_tool_calls(tokenizer) -> bool:
    """False when an assistant turn renders the same with a tool call as without."""
    if not getattr(tokenizer, "chat_template", None):
        return True
    turn = [*_PROBE_MESSAGES, {"role": "assistant", "content": ""}]
    plain = _render(tokenizer, turn)
    called = _render(tokenizer, [*_PROBE_MESSAGES, {**turn[-1], "tool_calls": [_PROBE_CALL]}])
    return plain is None or called is None or plain != called


def system_prompt(tools: list[dict[str, Any]]) -> str:
    signatures = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help with the user's request. The functions you may call "
        "are listed as JSON signatures inside <tools></tools>:\n"
        f"<tools>\n{signatures}\n</tools>\n"
        "To call a function, answer with one <tool_call></tool_call> block per call, each "
        "holding a JSON object with the function's name and its arguments:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {"<argument>": <value>}}\n'
        "</tool_call>"
    )


def call_text(calls: list[dict[str, Any]]) -> str:
    """Tool calls of an assistant turn, in the format the model is told to write them."""
    out = []
    for tc in calls:
        fn = tc.get("function") or {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # kept as the string the client sent
        body = json.dumps({"name": fn.get("name", ""), "arguments": args}, ensure_ascii=False)
        out.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(out)


def inject_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` with the tools in the system prompt (a leading system message gets them
    appended; otherwise a system message is added)."""
    if not tools:
        return messages
    block = system_prompt(tools)
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        first = out[0].get("content") or ""
        out[0]["content"] = f"{first}\n\n{block}" if first else block
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def inline_tool_calls(messages: list[dict]) -> list[dict]:
    """Assistant turns' `tool_calls` written into their content."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m = dict(m)
            text = call_text(m.pop("tool_calls"))
            m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
        out.append(m)
    return out
