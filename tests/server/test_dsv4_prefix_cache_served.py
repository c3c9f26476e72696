"""The prefix cache with DeepSeek-V4 behind real HTTP (official `openai` client, the tiny
DeepSeek-V4 agent, CPU float32): three-turn tool-calling conversations (question -> tool call,
tool result -> answer, a new question) give the same greedy tokens with the cache on as with
`--disable-prefix-cache`, at concurrency 1 and 16. Their prompts (~480-650 tokens) cross many
128-token pages (the page size: a multiple of the ratio-4 and ratio-128 compressors), HCA
windows and 64-token sliding windows, so a hit resumes from shared compressed entries, index
keys, window rows and the compressor state kept at the page end. The cache-on server's pool is
small: under 16 conversations it evicts, and outputs stay equal.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import openai
import pytest
from conftest import ServerProcess

AGENT = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "dsv4-tiny-agent"
pytestmark = pytest.mark.skipif(
    not (AGENT / "config.json").is_file(),
    reason=f"the tiny DeepSeek-V4 agent is not at {AGENT} (a checkout without ../shared)",
)

MODEL = "dsv4-tiny-agent"
PAGE = 128
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t} for k, t in props.items()},
                "required": list(props),
            },
        },
    }
    for name, desc, props in (
        ("get_weather", "Current weather of a city.", {"city": "string"}),
        ("add", "Add two integers.", {"a": "integer", "b": "integer"}),
        ("lookup", "Define a word.", {"word": "string"}),
    )
]
CITIES = ["Lima", "Oslo", "Cairo", "Quito", "Perth", "Delhi", "Kyoto", "Rome"]
WORDS = ["comet", "glacier", "harbor", "lantern"]
COMMON = ("--model", str(AGENT), "--device", "cpu", "--dtype", "float32")


@pytest.fixture(scope="module")
def servers():
    """Cache on with a small pool (24 pages of 128: evictions under 16 conversations) and a
    host tier (0.02 GiB: ~100 pages), and cache off with a roomy one; started side by side."""
    specs = {
        "on": (*COMMON, "--max-total-tokens", "3072", "--host-cache-gb", "0.02"),
        "off": (*COMMON, "--max-total-tokens", "16384", "--disable-prefix-cache"),
    }
    started: dict[str, ServerProcess | BaseException] = {}

    def start(name: str) -> None:
        try:
            started[name] = ServerProcess(*specs[name])
        except BaseException as e:  # noqa: BLE001 - re-raised below, after both are stopped
            started[name] = e

    # One engine thread each: this model's ops are tiny, and more threads only contend.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVRELAY_CPU_THREADS", "1")
        threads = [threading.Thread(target=start, args=(n,)) for n in specs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    try:
        for s in started.values():
            if isinstance(s, BaseException):
                raise s
        yield started
    finally:
        for s in started.values():
            if isinstance(s, ServerProcess):
                s.close()


def _question(i: int) -> tuple[str, str]:
    """Conversation i's question and the result its tool returns."""
    if i % 3 == 0:
        return f"What is the weather in {CITIES[i % 8]}?", f"rainy, {10 + i} C"
    if i % 3 == 1:
        return f"Add {i} and {40 + i}.", str(40 + 2 * i)
    word = WORDS[i % 4]
    return f"What does {word} mean?", f"a word that starts with {word[0]}"


async def _ask(client, messages: list[dict]) -> tuple[tuple, dict, int]:
    """(what must match between the servers, the assistant message to resend, cached tokens)."""
    r = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=128, temperature=0, logprobs=True
    )
    c = r.choices[0]
    calls = [
        (t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []
    ]
    tokens = [t.token for t in (c.logprobs.content or [])] if c.logprobs else []
    reply = {"role": "assistant", "content": c.message.content or ""}
    if c.message.tool_calls:
        reply["tool_calls"] = [t.model_dump() for t in c.message.tool_calls]
    seen = (tokens, c.message.content, calls, c.finish_reason, r.usage.prompt_tokens)
    return seen, reply, r.usage.prompt_tokens_details.cached_tokens


async def _conversations(server: ServerProcess, n: int, concurrency: int) -> list[list[tuple]]:
    """n three-turn conversations, `concurrency` at a time; per conversation, each turn's
    (what must match, cached tokens)."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> list[tuple]:
        question, result = _question(i)
        msgs = [SYSTEM, {"role": "user", "content": question}]
        turns = []
        async with sem:
            for follow_up in ("tool", f"Count from {i % 5} to {i % 5 + 5}.", None):
                seen, reply, cached = await _ask(client, msgs)
                turns.append((seen, cached))
                msgs.append(reply)
                if follow_up == "tool" and "tool_calls" in reply:
                    call_id = reply["tool_calls"][0]["id"]
                    msgs.append({"role": "tool", "tool_call_id": call_id, "content": result})
                elif follow_up:
                    msgs.append({"role": "user", "content": follow_up})
        return turns

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


def _both(servers, n: int, concurrency: int):
    on = asyncio.run(_conversations(servers["on"], n, concurrency))
    off = asyncio.run(_conversations(servers["off"], n, concurrency))
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        assert [t[0] for t in a] == [t[0] for t in b], f"conversation {i} differs"
    assert all(t[1] == 0 for conv in off for t in conv)  # the cache-off server reports none
    for conv in on:
        for seen, cached in conv:
            assert cached % PAGE == 0 and cached < seen[-1]  # whole pages, one token computed
    return on


def test_three_turns_concurrency_1_equal_and_later_turns_hit(servers):
    on = _both(servers, 3, 1)
    for conv in on:
        first, second, third = (cached for _, cached in conv)
        # turn 2 resends turn 1 (~480 prompt tokens + its reply): >= 3 pages; turn 3 more
        assert second >= 3 * PAGE and third >= second
        assert any(seen[2] for seen, _ in conv)  # the model really called a tool


def test_16_conversations_equal_under_eviction(servers):
    on = _both(servers, 16, 16)
    assert sum(c for conv in on for _, c in conv) > 16 * 3 * PAGE  # most turns hit
    s = servers["on"]
    assert s.metric("kvrelay_prefix_cache_evicted_pages_total") > 0  # the small pool evicted
    # ... to the host tier, and later turns loaded pages back from it
    assert s.metric("kvrelay_prefix_cache_host_offloaded_pages_total") > 0
    assert s.metric("kvrelay_prefix_cache_host_loaded_pages_total") > 0
    assert s.metric("kvrelay_prefix_cache_hit_tokens_total") > 0
    assert servers["off"].metric("kvrelay_prefix_cache_query_tokens_total") == 0


def test_n_samples_share_the_prompt_and_equal_one_sample(servers):
    """n=3 greedy samples of a new ~500-token prompt: the first prefills it, the other two
    resume from its cached pages (compressor state restored from the last shared page) and
    every sample equals the single greedy reply of the cache-off server."""
    # a system prompt no other test sends: nothing of this prompt is cached before
    system = {"role": "system", "content": "You are a helpful assistant for session n-7f3a."}
    messages = [system, {"role": "user", "content": "What is the weather in Nairobi today?"}]
    on, off = servers["on"], servers["off"]
    before = on.metric("kvrelay_prefix_cache_hit_tokens_total")
    want = openai.OpenAI(base_url=off.url + "/v1", api_key="unused").chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=48, temperature=0
    )
    got = openai.OpenAI(base_url=on.url + "/v1", api_key="unused").chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=48, temperature=0, n=3
    )
    one = want.choices[0].message
    assert len(got.choices) == 3
    for c in got.choices:
        assert (
            c.message.content,
            c.message.tool_calls and c.message.tool_calls[0].function.name,
        ) == (
            one.content,
            one.tool_calls and one.tool_calls[0].function.name,
        )
    pages = (want.usage.prompt_tokens - 1) // PAGE
    # exactly: the first sample found nothing, the other two every full page but the last token's
    assert on.metric("kvrelay_prefix_cache_hit_tokens_total") - before == 2 * pages * PAGE
