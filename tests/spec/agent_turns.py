"""Tool-calling-like conversations for speculative-decoding tests, through the official openai
client: a tool result the assistant is asked to repeat and then to read again (so its answer
copies spans of the prompt and of its earlier turn: n-gram drafts get accepted), two turns, and
a comparable result of each answer (text, tool calls, finish, token count, logprobs)."""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor

import openai

MODEL = "smollm2"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_forecast",
            "description": "The weather forecast of a city, day by day.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Perth", "Quito", "Hanoi", "Dakar"]
NUM_CONVERSATIONS = len(CITIES)
WEATHER = ["sunny", "rain", "cloudy", "windy", "snow"]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def conversation(i: int) -> list[dict]:
    city = CITIES[i % len(CITIES)]
    days = [
        {"day": d + 1, "sky": WEATHER[(i + d) % len(WEATHER)], "high_c": 10 + (i * 3 + d) % 15}
        for d in range(4)
    ]
    call = {"city": city, "days": 4}
    return [
        {"role": "system", "content": "You are a weather assistant. Quote tool results exactly."},
        {"role": "user", "content": f"What is the forecast for {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": "get_forecast", "arguments": json.dumps(call)}}]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps(days)},
        {"role": "user", "content": "Repeat the tool result exactly, as JSON."},
    ]  # fmt: skip


def ask(c: openai.OpenAI, messages: list[dict], max_tokens: int = 16) -> dict:
    r = c.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    ch = r.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
    lps = (ch.logprobs.content if ch.logprobs else None) or []
    return {
        "text": ch.message.content,
        "calls": calls,
        "finish": ch.finish_reason,
        "n": r.usage.completion_tokens,
        "lps": [x.logprob for x in lps],
        "tops": [[t.token for t in x.top_logprobs] for x in lps],
    }


def two_turns(url: str, convs: list[list[dict]], concurrency: int, answers=None) -> list[dict]:
    """Both turns of every conversation (`concurrency` at once); turn 2 resends turn 1 with
    `answers` (default: this server's own) and asks to read it again."""
    c = client(url)
    with ThreadPoolExecutor(concurrency) as ex:
        first = list(ex.map(lambda m: ask(c, m), convs))
        history = answers or first
        second = [
            [*m, {"role": "assistant", "content": a["text"] or ""},
             {"role": "user", "content": "Now list only the sky of each day, as JSON."}]
            for m, a in zip(convs, history, strict=True)
        ]  # fmt: skip
        return first + list(ex.map(lambda m: ask(c, m), second))


def assert_same(want: list[dict], got: list[dict]) -> None:
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        for key in ("text", "calls", "finish", "n", "tops"):
            assert g[key] == w[key], (i, key, w[key], g[key])
        assert len(g["lps"]) == len(w["lps"])
        assert all(abs(a - b) <= 1e-4 for a, b in zip(g["lps"], w["lps"], strict=True)), i


@functools.cache
def plain_turns(url: str) -> tuple[dict, ...]:
    """The plain server's answers to every conversation (8 at once), computed once per session
    for the single-server and the PD comparisons: turn 1 of each, then turn 2 of each."""
    convs = [conversation(i) for i in range(NUM_CONVERSATIONS)]
    return tuple(two_turns(url, convs, NUM_CONVERSATIONS))


def pick(turns, convs: list[int]) -> list[dict]:
    """Both turns of the conversations `convs`, in two_turns' order."""
    return [turns[i] for i in convs] + [turns[NUM_CONVERSATIONS + i] for i in convs]
