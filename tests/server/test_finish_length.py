"""finish_reason is "length" whenever max_tokens stopped the output, tool calls or not, and a
tool call cut off by max_tokens is never reported as a call (issue 28 item 5): its text stays
content. A call the model closed before the cut is still a call. Greedy, so the cut points found
on a first request hold for the later ones."""

from __future__ import annotations

import json
import random

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from kvrelay.server.chat_output import ChatOutputParser, message_dict
from kvrelay.server.tools.json_calls import JsonToolCallStreamParser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
OPEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'


def _parse(pieces: list[str], truncated: bool) -> dict:
    p = ChatOutputParser(JsonToolCallStreamParser())
    out = []
    for i, piece in enumerate(pieces):
        out += p.step(piece, i == len(pieces) - 1, truncated)
    return message_dict(out, False)


def test_an_open_call_counts_only_when_the_model_ended_it() -> None:
    ended = _parse([OPEN_CALL], truncated=False)  # EOS after a complete JSON: lenient
    assert [c["function"]["name"] for c in ended["tool_calls"]] == ["get_weather"]
    cut = _parse([OPEN_CALL], truncated=True)
    assert "tool_calls" not in cut and cut["content"] == OPEN_CALL
    rng = random.Random(0)
    for _ in range(10):  # streamed in any split == whole
        cuts = sorted(rng.sample(range(1, len(OPEN_CALL)), 5))
        pieces = [OPEN_CALL[a:b] for a, b in zip([0, *cuts], [*cuts, len(OPEN_CALL)], strict=True)]
        assert _parse(pieces, truncated=True) == cut


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _forced(client, max_tokens: int, **kw):
    return client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
        max_tokens=max_tokens, temperature=0, **kw,
    )  # fmt: skip


def _streamed(client, max_tokens: int):
    state = ChatCompletionStreamState()
    for chunk in _forced(client, max_tokens, stream=True):
        state.handle_chunk(chunk)
    return state.current_completion_snapshot.choices[0]


def test_a_call_cut_by_max_tokens_is_content_and_length(client) -> None:
    # The forced grammar makes SmolLM2 write two calls; 38 tokens end inside the second.
    first = _forced(client, 38, logprobs=True).choices[0]
    tokens = [t.token for t in first.logprobs.content]
    text = "".join(tokens)
    assert text.count("<tool_call>") == 2, text
    assert first.finish_reason == "length"  # was "tool_calls"
    calls = first.message.tool_calls or []
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}]
    second = text[text.index("<tool_call>", 1) :]
    assert first.message.content == second  # the cut call: raw text, never a call
    # Cut right after the first call's JSON closes, before its </tool_call>: still cut off.
    n = next(i + 1 for i in range(len(tokens)) if "".join(tokens[: i + 1]).endswith("}}"))
    for choice in (_forced(client, n).choices[0], _streamed(client, n)):
        assert choice.finish_reason == "length"
        assert not choice.message.tool_calls  # was parsed into a complete call
        assert choice.message.content == "".join(tokens[:n])
