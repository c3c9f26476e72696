"""Tool calls and reasoning through the chat API: the stream→OpenAI-delta conversion, and live
requests (SmolLM2 with its HF template; dsv4-tiny with the DeepSeek-V4 encoding and DSML)."""

from __future__ import annotations

import json
import random

import openai
import pytest
from conftest import ServerProcess
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from pydantic import ValidationError

from kvrelay.server.chat_format import ChatFormat, dsv4_thinking
from kvrelay.server.chat_output import ChatOutputParser, delta_dict, message_dict
from kvrelay.server.schemas import ChatCompletionRequest
from kvrelay.server.tools.dsml import DsmlStreamParser, ToolCall, encode_tool_calls
from kvrelay.server.tools.dsv4_chat import encode_messages
from kvrelay.server.tools.json_calls import JsonToolCallStreamParser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CALLS = [
    ToolCall("", "get_weather", json.dumps({"city": "杭州", "days": 5}, ensure_ascii=False)),
    ToolCall("", "get_weather", json.dumps({"city": "Paris <b>", "opts": {"u": [1, None]}})),
]
DSML_TEXT = "Let me check." + encode_tool_calls(CALLS)
JSON_TEXT = "Let me check.\n" + "\n".join(
    f'<tool_call>\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n</tool_call>' for c in CALLS
)
EXPECTED_CALLS = [(c.name, json.loads(c.arguments)) for c in CALLS]


def _dsml(reasoning: bool = False) -> ChatOutputParser:
    return ChatOutputParser(DsmlStreamParser("call_x_"), reasoning)


def _json() -> ChatOutputParser:
    return ChatOutputParser(JsonToolCallStreamParser("call_x_"))


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.randrange(len(text) + 1) for _ in range(rng.randint(0, 40)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _streamed(parser: ChatOutputParser, pieces: list[str]) -> dict:
    """Chunks as the route builds them, accumulated by the official client's stream state."""
    state = ChatCompletionStreamState()
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = delta_dict(parser.step(piece, final=last))
        if i == 0:
            delta = {"role": "assistant", **delta}
        reason = ("tool_calls" if parser.tool_calls else "stop") if last else None
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
        }
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return _message(state.get_final_completion().choices[0].message.model_dump())


def _message(msg: dict) -> dict:
    """The fields both response kinds must agree on."""
    calls = [
        (c["id"], c["type"], c["function"]["name"], c["function"]["arguments"])
        for c in msg.get("tool_calls") or []
    ]
    return {
        "content": msg.get("content"),
        "reasoning": msg.get("reasoning_content"),
        "calls": calls,
    }


def _whole(parser: ChatOutputParser, text: str) -> dict:
    return _message(message_dict(parser.step(text, final=True), parser.reasoning))


# ----------------------------------------------------------------- stream == whole


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (_dsml, DSML_TEXT),
        (lambda: _dsml(reasoning=True), "I should look it up.</think>" + DSML_TEXT),
        (_json, JSON_TEXT),
        (_json, JSON_TEXT + "\n\nDone."),
    ],
    ids=["dsml", "dsml-thinking", "json", "json-then-text"],
)
def test_stream_accumulates_to_the_whole_message(make, text: str) -> None:
    whole = _whole(make(), text)
    assert whole["content"].startswith("Let me check.") and not whole["content"].endswith("\n")
    assert [(n, json.loads(a)) for _, _, n, a in whole["calls"]] == EXPECTED_CALLS
    assert [(i, t) for i, t, _, _ in whole["calls"]] == [
        ("call_x_0", "function"),
        ("call_x_1", "function"),
    ]
    rng = random.Random(0)
    for _ in range(30):
        assert _streamed(make(), _pieces(text, rng)) == whole
    assert _streamed(make(), list(text)) == whole  # one character at a time


def test_thinking_reasoning_goes_to_reasoning_content() -> None:
    text = "Two plus two.</think>It is 4."
    whole = _whole(ChatOutputParser(None, reasoning=True), text)
    assert whole == {"content": "It is 4.", "reasoning": "Two plus two.", "calls": []}
    rng = random.Random(1)
    for _ in range(20):
        assert _streamed(ChatOutputParser(None, reasoning=True), _pieces(text, rng)) == whole


def test_streamed_call_delta_is_openai_shaped() -> None:
    parser = _dsml()
    deltas = [delta_dict(parser.step(p, final=False)) for p in DSML_TEXT] + [
        delta_dict(parser.finish())
    ]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0] == {
        "index": 0,
        "id": "call_x_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": CALLS[0].arguments},
    }
    assert [c["index"] for c in calls] == [0, 1]


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (_dsml, "Hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter"),
        (_dsml, '<｜DSML｜tool_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="a" '
         'string="false">{bad</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>'),
        (_dsml, "stray ｜DSML｜ marker"),
        (_json, "Hi <tool_call>{not json}</tool_call> there"),
        (_json, '<tool_call>{"arguments": {}}</tool_call>'),
        (_json, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
        (_json, "text then <tool_call>"),
    ],
)  # fmt: skip
def test_malformed_stays_content(make, text: str) -> None:
    parser = make()
    whole = _whole(parser, text)
    assert whole["calls"] == [] and parser.errors and parser.tool_calls == 0
    assert whole["content"] and whole["content"].replace("\n", "").replace(" ", "") != ""
    for seed in range(10):
        assert _streamed(make(), _pieces(text, random.Random(seed))) == whole


def test_malformed_json_call_keeps_its_text() -> None:
    text = "Hi <tool_call>{not json}</tool_call> there"
    assert _whole(_json(), text)["content"] == text


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain text, no call", "plain text, no call", []),
        ('<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", {"a": 1})]),
        ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', None, [("f", {"a": 1})]),
        ('\n<tool_call>{"name": "f", "arguments": {}}', None, [("f", {})]),  # cut before the close
        ('A<tool_call>{"name": "f"}</tool_call>\n<tool_call>{"name": "g"}</tool_call>\nB', "AB",
         [("f", {}), ("g", {})]),
    ],
)  # fmt: skip
def test_json_style_calls(text: str, content: str | None, calls: list) -> None:
    whole = _whole(_json(), text)
    assert whole["content"] == content
    assert [(n, json.loads(a)) for _, _, n, a in whole["calls"]] == calls
    for seed in range(10):
        assert _streamed(_json(), _pieces(text, random.Random(seed))) == whole


# ------------------------------------------------------------------ chat format


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **kw}
    )


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, (False, None)),
        ({"chat_template_kwargs": {"thinking": True}}, (True, None)),
        ({"chat_template_kwargs": {"enable_thinking": True}}, (True, None)),
        ({"chat_template_kwargs": {"thinking": False, "enable_thinking": True}}, (False, None)),
        ({"chat_template_kwargs": {"thinking": True}, "reasoning_effort": "max"}, (True, "max")),
        ({"chat_template_kwargs": {"thinking": True}, "reasoning_effort": "high"}, (True, None)),
        ({"chat_template_kwargs": {"thinking": True}, "reasoning_effort": "none"}, (False, None)),
    ],
)
def test_dsv4_thinking_switch(kw: dict, expected: tuple) -> None:
    assert dsv4_thinking(_req(**kw)) == expected


def test_dsv4_prompt_is_the_dsv4_encoding(smollm2_tokenizer) -> None:
    req = _req(tools=TOOLS, chat_template_kwargs={"thinking": True})
    ids = ChatFormat("DeepseekV4ForCausalLM", smollm2_tokenizer).prompt_ids(req)
    text = encode_messages([{"role": "user", "content": "Weather in Paris?"}], TOOLS, thinking=True)
    assert ids == smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert text.endswith("<｜Assistant｜><think>") and "## Tools" in text


def test_output_parser_choice(smollm2_tokenizer) -> None:
    dsv4 = ChatFormat("DeepseekV4ForCausalLM", smollm2_tokenizer)
    llama = ChatFormat("LlamaForCausalLM", smollm2_tokenizer)
    assert dsv4.output_parser(_req(), "c_") is None
    assert llama.output_parser(_req(), "c_") is None
    assert llama.output_parser(_req(tools=TOOLS, tool_choice="none"), "c_") is None
    p = dsv4.output_parser(_req(tools=TOOLS, chat_template_kwargs={"thinking": True}), "c_")
    assert isinstance(p.tools, DsmlStreamParser) and p.reasoning
    p = llama.output_parser(_req(tools=TOOLS, chat_template_kwargs={"thinking": True}), "c_")
    assert isinstance(p.tools, JsonToolCallStreamParser) and not p.reasoning


@pytest.mark.parametrize(
    "kw", [{"tool_choice": "sometimes"}, {"tool_choice": {"type": "function"}}, {"tool_choice": "required"}]
)  # fmt: skip
def test_bad_tool_choice_is_rejected(kw: dict) -> None:
    with pytest.raises(ValidationError):
        _req(**kw)


# ------------------------------------------------------------------ live servers


def _check_response(r, stream_msg: dict | None = None) -> None:
    """Well-formed OpenAI answer; tool calls (if any) carry ids and JSON-object arguments."""
    c = r.choices[0]
    calls = c.message.tool_calls or []
    for tc in calls:
        assert tc.id and tc.type == "function" and tc.function.name
        assert isinstance(json.loads(tc.function.arguments), dict)
    assert c.finish_reason == ("tool_calls" if calls else c.finish_reason)
    assert c.finish_reason in ("stop", "length", "tool_calls")
    if stream_msg is not None:
        assert _message(c.message.model_dump()) == stream_msg


def _chat(client, model: str, stream: bool, max_tokens: int = 8, **kw):
    args = dict(model=model, max_tokens=max_tokens, temperature=0, **kw)
    if not stream:
        return client.chat.completions.create(**args), None
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(stream=True, **args):
        state.handle_chunk(chunk)
    # The snapshot, not get_final_completion(): that one raises on finish_reason "length".
    final = state.current_completion_snapshot
    return final, _message(final.choices[0].message.model_dump())


def test_smollm2_with_tools(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    whole, _ = _chat(client, "smollm2", False, messages=msgs, tools=TOOLS)
    streamed, acc = _chat(client, "smollm2", True, messages=msgs, tools=TOOLS)
    _check_response(whole, acc)
    _check_response(streamed)
    # A tool-call round trip renders through the HF template.
    history = [
        *msgs,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]  # fmt: skip
    r, _ = _chat(client, "smollm2", False, messages=history, tools=TOOLS, tool_choice="auto")
    _check_response(r)


@pytest.fixture(scope="module")
def dsv4_server():
    s = ServerProcess(
        "--model", "dsv4-tiny", "--load-format", "dummy", "--max-total-tokens", "4096"
    )  # fmt: skip
    yield s
    s.close()


def test_dsv4_tiny_chat_and_tools(dsv4_server) -> None:
    """Random weights emit no DSML: this shows the route end to end; the parse is unit-tested."""
    client = openai.OpenAI(base_url=dsv4_server.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    thinking = {"chat_template_kwargs": {"thinking": True}}
    for kw in ({}, {"tools": TOOLS, "extra_body": thinking}):
        whole, _ = _chat(client, "dsv4-tiny", False, messages=msgs, **kw)
        streamed, acc = _chat(client, "dsv4-tiny", True, messages=msgs, **kw)
        _check_response(whole, acc)  # greedy: the stream accumulates to the whole message
        _check_response(streamed)
        extra = whole.choices[0].message.model_extra
        assert ("reasoning_content" in extra) == ("extra_body" in kw)
    # A tool-call round trip in chat mode: the call and its result are encoded into the prompt.
    history = [
        *msgs,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]  # fmt: skip
    r, _ = _chat(client, "dsv4-tiny", False, messages=history, tools=TOOLS)
    _check_response(r)
    assert r.usage.prompt_tokens > whole.usage.prompt_tokens
