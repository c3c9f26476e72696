"""Golden tests of the DeepSeek-V4 prompt encoding and the reasoning split.

Every expected string is written out by hand from reference/deepseek-v4.md §8 and its source,
vLLM's deepseek_v4_encoding.py (the tools section text and the Reasoning-Effort preamble are
that file's literals).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.server.tools.dsv4_chat import (
    ChatEncodingError,
    ReasoningStreamSplitter,
    encode_messages,
    reasoning_split,
)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

TOOLS_SECTION = (
    "## Tools\n"
    "\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools"
    ' by writing a "<｜DSML｜tool_calls>" block like the following:\n'
    "\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    "</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n"
    "\n"
    'String parameters should be specified as is and set `string="true"`. For all other types'
    " (numbers, booleans, arrays, objects), pass the value in JSON format and set"
    ' `string="false"`.\n'
    "\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning"
    " inside <think>...</think> BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
    '{"name": "get_weather", "description": "Get the weather for a city.", "parameters":'
    ' {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}\n'
    "\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool"
    " calls.\n"
)


def _call(id_: str, city: str) -> dict:
    args = '{"city": "' + city + '"}'
    return {"id": id_, "type": "function", "function": {"name": "get_weather", "arguments": args}}


def _dsml(*cities: str) -> str:
    invokes = [
        '<｜DSML｜invoke name="get_weather">\n'
        f'<｜DSML｜parameter name="city" string="true">{c}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>"
        for c in cities
    ]
    return "\n\n<｜DSML｜tool_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜tool_calls>"


SYS = {"role": "system", "content": "You are a helpful assistant."}
HI = {"role": "user", "content": "Hi"}
HELLO = {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets me."}
HOW = {"role": "user", "content": "How are you?"}


def test_plain_chat() -> None:
    got = encode_messages([{"role": "user", "content": "Hello"}])
    assert got == BOS + "<｜User｜>Hello<｜Assistant｜></think>"


def test_system_prompt() -> None:
    got = encode_messages([SYS, HI])
    assert got == BOS + "You are a helpful assistant.<｜User｜>Hi<｜Assistant｜></think>"


def test_multi_turn_chat_mode() -> None:
    got = encode_messages([SYS, HI, HELLO, HOW])
    assert got == (
        BOS + "You are a helpful assistant."
        "<｜User｜>Hi<｜Assistant｜></think>Hello!"
        + EOS
        + "<｜User｜>How are you?<｜Assistant｜></think>"
    )


def test_thinking_mode_opens_think() -> None:
    assert encode_messages([HI], thinking=True) == BOS + "<｜User｜>Hi<｜Assistant｜><think>"


def test_thinking_mode_drops_earlier_reasoning() -> None:
    got = encode_messages([SYS, HI, HELLO, HOW], thinking=True)
    assert got == (
        BOS + "You are a helpful assistant."
        "<｜User｜>Hi<｜Assistant｜></think>Hello!"
        + EOS
        + "<｜User｜>How are you?<｜Assistant｜><think>"
    )


def test_thinking_mode_keeps_reasoning_when_tools_present() -> None:
    got = encode_messages([HI, HELLO, HOW], tools=[WEATHER_TOOL], thinking=True)
    assert got == (
        BOS
        + "\n\n"
        + TOOLS_SECTION
        + "<｜User｜>Hi<｜Assistant｜><think>The user greets me.</think>"
        "Hello!" + EOS + "<｜User｜>How are you?<｜Assistant｜><think>"
    )


def test_tools_section_follows_system_prompt() -> None:
    got = encode_messages([SYS, HI], tools=[WEATHER_TOOL])
    assert got == (
        BOS
        + "You are a helpful assistant.\n\n"
        + TOOLS_SECTION
        + "<｜User｜>Hi<｜Assistant｜></think>"
    )


def test_tool_calls_then_results_folded_into_next_user_turn() -> None:
    messages = [
        SYS,
        {"role": "user", "content": "Weather in Hangzhou and Beijing?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [_call("c1", "杭州"), _call("c2", "北京")]},
        # Results arrive out of order; they are put back in call order.
        {"role": "tool", "tool_call_id": "c2", "content": "Sunny, 30°C"},
        {"role": "tool", "tool_call_id": "c1", "content": "Rain, 22°C"},
        {"role": "assistant", "content": "Hangzhou: rain. Beijing: sunny."},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    got = encode_messages(messages, tools=[WEATHER_TOOL])
    assert got == (
        BOS + "You are a helpful assistant.\n\n" + TOOLS_SECTION + "<｜User｜>Weather in Hangzhou and Beijing?"
        "<｜Assistant｜></think>Let me check." + _dsml("杭州", "北京") + EOS +
        "<｜User｜><tool_result>Rain, 22°C</tool_result>\n\n<tool_result>Sunny, 30°C</tool_result>"
        "<｜Assistant｜></think>Hangzhou: rain. Beijing: sunny." + EOS +
        "<｜User｜>Thanks<｜Assistant｜></think>"
    )  # fmt: skip


def test_consecutive_tool_results_and_user_text_share_one_turn() -> None:
    messages = [
        {"role": "user", "content": "Compare."},
        {"role": "assistant", "content": None, "tool_calls": [_call("a", "A"), _call("b", "B")]},
        {"role": "tool", "tool_call_id": "a", "content": "1"},
        {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "2"}]},
        {"role": "user", "content": "And tomorrow?"},
    ]
    got = encode_messages(messages, tools=[WEATHER_TOOL])
    assert got == (
        BOS + "\n\n" + TOOLS_SECTION + "<｜User｜>Compare.<｜Assistant｜></think>" + _dsml("A", "B") + EOS +
        "<｜User｜><tool_result>1</tool_result>\n\n<tool_result>2</tool_result>\n\nAnd tomorrow?"
        "<｜Assistant｜></think>"
    )  # fmt: skip


def _tool_loop() -> list[dict]:
    return [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need data.", "tool_calls": [_call("a", "X")]},
        {"role": "tool", "tool_call_id": "a", "content": "Fog"},
    ]  # fmt: skip


def test_thinking_tool_loop_with_tools_keeps_reasoning() -> None:
    got = encode_messages(_tool_loop(), tools=[WEATHER_TOOL], thinking=True)
    assert got == (
        BOS + "\n\n" + TOOLS_SECTION + "<｜User｜>Weather?<｜Assistant｜><think>Need data.</think>" +
        _dsml("X") + EOS + "<｜User｜><tool_result>Fog</tool_result><｜Assistant｜><think>"
    )  # fmt: skip


def test_thinking_tool_loop_without_tools_drops_reasoning() -> None:
    # The tool result is the last user turn, so the call before it loses its reasoning.
    got = encode_messages(_tool_loop(), thinking=True)
    assert got == (
        BOS + "<｜User｜>Weather?<｜Assistant｜></think>" + _dsml("X") + EOS +
        "<｜User｜><tool_result>Fog</tool_result><｜Assistant｜><think>"
    )  # fmt: skip


def test_final_assistant_turn_after_last_user_keeps_reasoning() -> None:
    got = encode_messages([HI, HELLO], thinking=True)
    assert got == BOS + "<｜User｜>Hi<｜Assistant｜><think>The user greets me.</think>Hello!" + EOS


def test_no_generation_prompt() -> None:
    got = encode_messages([SYS, HI], add_generation_prompt=False)
    assert got == BOS + "You are a helpful assistant.<｜User｜>Hi"


def test_reasoning_effort_max_preamble() -> None:
    got = encode_messages([HI], thinking=True, reasoning_effort="max")
    assert got == (
        BOS + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem to"
        " resolve the root cause, rigorously stress-testing your logic against all potential"
        " paths, edge cases, and adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate"
        " step, considered alternative, and rejected hypothesis to ensure absolutely no"
        " assumption is left unchecked.\n\n"
        "<｜User｜>Hi<｜Assistant｜><think>"
    )
    assert encode_messages([HI], reasoning_effort="max") == encode_messages([HI])  # chat mode


def test_tool_call_arguments_as_dict_and_empty() -> None:
    calls = [
        {"id": "a", "function": {"name": "f", "arguments": {"n": [1, 2]}}},
        {"id": "b", "function": {"name": "g", "arguments": ""}},
    ]
    got = encode_messages([HI, {"role": "assistant", "content": "ok", "tool_calls": calls}])
    assert got == (
        BOS + "<｜User｜>Hi<｜Assistant｜></think>ok\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="n" string="false">[1, 2]</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="g">\n\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>" + EOS
    )


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "robot", "content": "x"}],
        [HI, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
        [HI, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[]"}}]}],
        [HI, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ],
)
def test_bad_messages_raise_chat_encoding_error(messages: list[dict]) -> None:
    with pytest.raises(ChatEncodingError):
        encode_messages(messages)


# --------------------------------------------------------------------- reasoning split


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
        ("<think>again</think>x", "again", "x"),
        ("still thinking", "still thinking", ""),
        ("", "", ""),
        ("r</think>", "r", ""),
        # A tool block before </think> ends the reasoning; the block goes to the DSML parser.
        ("r\n\n<｜DSML｜tool_calls>\n…", "r", "\n\n<｜DSML｜tool_calls>\n…"),
        ("a</think>b</think>c", "a", "b</think>c"),
    ],
)
def test_reasoning_split(text: str, reasoning: str, content: str) -> None:
    assert reasoning_split(text) == (reasoning, content)


@settings(max_examples=200, deadline=None)
@given(
    text=st.lists(
        st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", "\n\n", "<｜DSML｜tool_calls>", "<｜DSML｜"]),
        max_size=12,
    ).map("".join),
    seed=st.integers(0, 2**32),
)  # fmt: skip
def test_reasoning_stream_equals_whole(text: str, seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted({0, len(text), *(rng.randrange(len(text) + 1) for _ in range(rng.randint(0, 8)))})
    for bounds in (cuts, list(range(len(text) + 1))):
        s = ReasoningStreamSplitter()
        parts = [s.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)] + [s.finish()]
        got = ("".join(p[0] for p in parts), "".join(p[1] for p in parts))
        assert got == reasoning_split(text)
