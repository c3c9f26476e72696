"""Which chat format a model speaks: how a request becomes prompt ids, how output is parsed.

The model family's registry entry names the format. DeepSeek-V4 ("dsv4"): kvrelay's own encoder
(tools/dsv4_chat.py), DSML tool calls, and reasoning in thinking mode. "hf_template": the
tokenizer's HF chat template and JSON-style `<tool_call>` tool calls.
"""

from __future__ import annotations

import json
import logging

from kvrelay.models import registry
from kvrelay.server.chat_output import ChatOutputParser
from kvrelay.server.schemas import ChatCompletionRequest
from kvrelay.server.tokenizer import apply_chat_template
from kvrelay.server.tools.dsml import DsmlStreamParser
from kvrelay.server.tools.dsv4_chat import encode_messages
from kvrelay.server.tools.json_calls import JsonToolCallStreamParser
from kvrelay.server.tools.tool_prompt import (
    inject_tools,
    inline_tool_calls,
    renders_tool_calls,
    renders_tools,
)

log = logging.getLogger("kvrelay.api")


class UnsupportedField(ValueError):
    """A request field this chat format cannot honour (the API's 400 names it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def parses_tools(req: ChatCompletionRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def dsv4_thinking(req: ChatCompletionRequest) -> tuple[bool, str | None]:
    """(thinking mode, reasoning effort) as vLLM's DeepSeek-V4 tokenizer reads them.

    `chat_template_kwargs.thinking` (or `enable_thinking`) switches thinking on; the
    `reasoning_effort` field (or the kwarg) "none" forces chat mode, "max"/"xhigh" asks for
    the maximal-effort preamble; other efforts change nothing.
    """
    kw = req.chat_template_kwargs or {}
    thinking = kw.get("thinking")
    thinking = bool(kw.get("enable_thinking", False) if thinking is None else thinking)
    effort = req.reasoning_effort or kw.get("reasoning_effort")
    if effort == "none":
        return False, None
    return thinking, "max" if effort in ("max", "xhigh") else None


class ChatFormat:
    def __init__(self, architecture: str, tokenizer) -> None:
        self.dsv4 = registry.family(architecture).chat_format == registry.DSV4_CHAT
        self.tokenizer = tokenizer
        # Probed once: does the HF template show the model its tools and earlier calls?
        self.inject_tools = not self.dsv4 and not renders_tools(tokenizer)
        self.inline_calls = not self.dsv4 and not renders_tool_calls(tokenizer)
        self._logged = False

    def messages(self, req: ChatCompletionRequest) -> list[dict]:
        """The HF template's input: the messages, with the tools in the system prompt where
        the template would drop them."""
        messages = [_hf_message(m) for m in req.messages]
        if self.inline_calls:
            messages = inline_tool_calls(messages)
        tools = req.tool_dicts if req.tool_choice != "none" else None
        if self.inject_tools and tools:
            if not self._logged:
                self._logged = True
                log.warning(
                    "the chat template does not render tools: kvrelay puts the tool signatures "
                    "and the <tool_call> format into the system prompt (logged once)"
                )
            messages = inject_tools(messages, tools)
        return messages

    def prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        """Raises ValueError (the API's 400) when the messages cannot be encoded."""
        if not self.dsv4:
            tools = None if self.inject_tools else req.tool_dicts
            cont = req.continue_final_message
            gen_prompt = not cont and req.add_generation_prompt is not False
            return apply_chat_template(self.tokenizer, self.messages(req), tools, gen_prompt, cont)
        if req.continue_final_message or req.add_generation_prompt is False:
            field = (
                "continue_final_message" if req.continue_final_message else "add_generation_prompt"
            )
            raise UnsupportedField(
                field, "is not supported by this model's chat encoder (DeepSeek-V4)"
            )
        thinking, effort = dsv4_thinking(req)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        text = encode_messages(messages, req.tool_dicts, thinking=thinking, reasoning_effort=effort)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def output_parser(self, req: ChatCompletionRequest, id_prefix: str) -> ChatOutputParser | None:
        """None when the output is plain content (no tools to parse, no reasoning to split)."""
        reasoning = self.dsv4 and dsv4_thinking(req)[0]
        tools = None
        if parses_tools(req):
            tools = (DsmlStreamParser if self.dsv4 else JsonToolCallStreamParser)(id_prefix)
        if tools is None and not reasoning:
            return None
        return ChatOutputParser(tools, reasoning)


def _hf_message(m) -> dict:
    d = {"role": m.role, "content": m.text() or ""}
    if m.tool_calls:
        d["tool_calls"] = [_hf_tool_call(tc.model_dump(exclude_none=True)) for tc in m.tool_calls]
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.name:
        d["name"] = m.name
    return d


def _hf_tool_call(tc: dict) -> dict:
    """HF templates render arguments with `tojson`: give them the object, not its JSON text."""
    fn = tc.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return tc
    try:
        args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
    except json.JSONDecodeError:
        return tc
    return {**tc, "function": {**fn, "arguments": args}}
