"""The prefix cache behind real HTTP (official `openai` client, embedded SmolLM2, CPU float32):
multi-turn conversations whose turn 2 resends turn 1 give the same greedy tokens with the cache on
as with `--disable-prefix-cache`, at concurrency 1 and 16 (16 conversations sharing a long system
prompt); hits report usage.prompt_tokens_details.cached_tokens; the cache-on server's KV pool is
small, so the cache evicts under that load (to its host tier, --host-cache-gb) and outputs stay
equal; a conversation pushed out to host memory hits its pages there on its next turn."""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest
from conftest import SMOLLM2_F32_NO_CACHE, SMOLLM2_F32_SMALL_POOL, ServerProcess

MODEL = "smollm2"
SYSTEM = "You are the help desk of the Northwind lighthouse museum. " + " ".join(
    f"Rule {k}: answer in one short sentence, stay polite, and mention room {k} if asked."
    for k in range(12)
)


@pytest.fixture(scope="module")
def servers(shared_servers):
    """Cache on with a small pool (40 pages of 16: evictions under 16 conversations) and a host
    tier of 72 pages, and cache off with a roomy one; shared with other served modules (so
    counters are read as deltas)."""
    return shared_servers.get({"on": SMOLLM2_F32_SMALL_POOL, "off": SMOLLM2_F32_NO_CACHE})


def _client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


async def _ask(client, messages: list[dict]) -> tuple[list[str], str, int]:
    r = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True
    )
    c = r.choices[0]
    details = r.usage.prompt_tokens_details
    return [t.token for t in c.logprobs.content], c.message.content, details.cached_tokens


async def _conversations(server: ServerProcess, n: int, concurrency: int) -> list[list[tuple]]:
    """n two-turn conversations (turn 2 resends turn 1 and its answer); `concurrency` of them
    at a time. Returns, per conversation, each turn's (tokens, text, cached_tokens)."""
    client = _client(server)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> list[tuple]:
        async with sem:
            msgs = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Visitor {i}: when does the museum open?"},
            ]
            first = await _ask(client, msgs)
            msgs += [
                {"role": "assistant", "content": first[1]},
                {"role": "user", "content": "And which room has the lens?"},
            ]
            return [first, await _ask(client, msgs)]

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()


def _both(servers, n: int, concurrency: int):
    on = asyncio.run(_conversations(servers["on"], n, concurrency))
    off = asyncio.run(_conversations(servers["off"], n, concurrency))
    return on, off


def test_multi_turn_concurrency_1_equal_and_turn_2_hits(servers):
    on, off = _both(servers, 2, 1)
    assert [[t[:2] for t in conv] for conv in on] == [[t[:2] for t in conv] for conv in off]
    assert all(t[2] == 0 for conv in off for t in conv)  # the cache-off server reports none
    for first, second in on:
        assert second[2] >= first[2] and second[2] > 100  # turn 1 is cached (system prompt+)
        assert second[2] % 16 == 0  # whole pages


def _counters(s: ServerProcess) -> tuple[float, ...]:
    names = ("evicted_pages", "hit_tokens", "query_tokens", "host_offloaded_pages")
    return tuple(s.metric(f"kvrelay_prefix_cache_{n}_total") for n in names)


def test_16_conversations_sharing_a_system_prompt_equal_under_eviction(servers):
    s = servers["on"]
    evicted0, hit0, query0, offloaded0 = _counters(s)
    on, off = _both(servers, 16, 16)
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        assert [t[:2] for t in a] == [t[:2] for t in b], f"conversation {i} differs"
    assert sum(t[2] for conv in on for t in conv) > 16 * 100  # most turns hit the system prompt
    evicted, hit, query, offloaded = _counters(s)
    assert evicted > evicted0  # the small pool evicted under these 16 conversations
    assert offloaded - offloaded0 == evicted - evicted0  # all of it to the host tier
    assert 0 < hit - hit0 < query - query0
    assert s.metric("kvrelay_prefix_cache_hit_rate") == pytest.approx(hit / query, rel=0.05)
    assert servers["off"].metric("kvrelay_prefix_cache_query_tokens_total") == 0


def test_streamed_chat_and_completions_report_cached_tokens(servers):
    client = openai.OpenAI(base_url=servers["on"].url + "/v1", api_key="unused", max_retries=0)
    prompt = SYSTEM + " Question: what is a lens?"
    for _ in range(2):  # the second one finds the first in the cache
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16 * (r.usage.prompt_tokens // 16 - 1)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    usage = None
    for _ in range(2):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            usage = chunk.usage or usage
    assert usage.prompt_tokens_details.cached_tokens > 100


def test_a_conversation_pushed_to_host_memory_hits_there_and_equals_cache_off(servers):
    """Turn 1 of a conversation, then three long prompts that need the whole device pool (its
    pages go to the host tier), then its turn 2: the prefix comes back from host memory, and the
    tokens equal the cache-off server's."""
    on, off = servers["on"], servers["off"]
    system = f"Session {uuid.uuid4().hex}. {SYSTEM}"
    names = ("kvrelay_prefix_cache_host_offloaded_pages_total",
             "kvrelay_prefix_cache_host_loaded_pages_total")  # fmt: skip
    offloaded0, loaded0 = (on.metric(n) for n in names)

    async def conversation(server: ServerProcess, flood: bool) -> list[tuple]:
        client = _client(server)
        try:
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}]
            first = await _ask(client, msgs)
            for _ in range(3 if flood else 0):  # other sessions, one at a time
                other = [{"role": "system", "content": f"Session {uuid.uuid4().hex}. {SYSTEM}"}]
                await client.chat.completions.create(model=MODEL, messages=other, max_tokens=1)
            msgs += [
                {"role": "assistant", "content": first[1]},
                {"role": "user", "content": "Where is room 3?"},
            ]
            return [first, await _ask(client, msgs)]
        finally:
            await client.close()

    got = asyncio.run(conversation(on, flood=True))
    want = asyncio.run(conversation(off, flood=False))
    assert [t[:2] for t in got] == [t[:2] for t in want]
    offloaded, loaded = (on.metric(n) for n in names)
    assert offloaded > offloaded0 and loaded > loaded0
    assert got[1][2] > 200  # turn 1's pages, loaded back from host memory
    assert on.metric("kvrelay_prefix_cache_host_pages") > 0
