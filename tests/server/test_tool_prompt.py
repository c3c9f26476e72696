"""Tools for a chat template that drops them (SmolLM2's): detected by rendering with and without
a tool, then put into the system prompt with the <tool_call> format the JSON parser reads;
earlier calls in the history are written in that format."""

from __future__ import annotations

import json

import httpx
import pytest

from kvrelay.server.chat_format import ChatFormat
from kvrelay.server.schemas import ChatCompletionRequest
from kvrelay.server.tools.json_calls import JsonToolCallStreamParser
from kvrelay.server.tools.tool_prompt import renders_tools, system_prompt

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _prompt(tok, **kw) -> str:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **kw})
    return tok.decode(ChatFormat("LlamaForCausalLM", tok).prompt_ids(req))


def test_smollm2_template_is_detected_as_dropping_tools(smollm2_tokenizer):
    assert not renders_tools(smollm2_tokenizer)
    assert ChatFormat("LlamaForCausalLM", smollm2_tokenizer).inject_tools


def test_the_prompt_carries_the_tool_signature_and_call_format(smollm2_tokenizer):
    text = _prompt(smollm2_tokenizer, tools=TOOLS)
    signature = json.dumps(TOOLS[0]["function"], ensure_ascii=False)
    assert signature in text and "<tool_call>" in text
    assert text.index(signature) < text.index("Weather in Paris?")  # in the system turn
    assert "<|im_start|>system\n" in text
    assert _prompt(smollm2_tokenizer, tools=TOOLS, tool_choice="none") == _prompt(smollm2_tokenizer)
    system = [{"role": "system", "content": "Be brief."}, *ASK]
    text = _prompt(smollm2_tokenizer, tools=TOOLS, messages=system)
    assert "Be brief.\n\n" + system_prompt(TOOLS) in text


def test_the_format_taught_is_the_one_parsed():
    """The example call in the system prompt, with real values, parses as a tool call."""
    example = system_prompt(TOOLS).split("</tools>\n", 1)[1]
    call = example[example.rindex("<tool_call>") :].replace("<function name>", "get_weather")
    call = call.replace('"<argument>": <value>', '"city": "Paris"')
    p = JsonToolCallStreamParser("c_")
    deltas = p.feed(call) + p.finish()
    assert not p.errors and [d.name for d in deltas] == ["get_weather"]


def test_history_calls_are_written_in_the_call_format(smollm2_tokenizer):
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]  # fmt: skip
    text = _prompt(smollm2_tokenizer, tools=TOOLS, messages=history)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )


@pytest.mark.parametrize("stream", [False, True])
def test_live_tools_reach_the_prompt(server, stream):
    def prompt_tokens(**kw) -> int:
        body = {"model": "smollm2", "messages": ASK, "max_tokens": 1, "temperature": 0, **kw}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream(
                "POST", server.url + "/v1/chat/completions", json=body, timeout=60
            ) as r:
                events = [x[6:] for x in r.iter_lines() if x.startswith("data: {")]
            return json.loads(events[-1])["usage"]["prompt_tokens"]
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        return r.json()["usage"]["prompt_tokens"]

    with_tools, without = prompt_tokens(tools=TOOLS), prompt_tokens()
    assert with_tools > without + 40  # the signature and the format are in the prompt
