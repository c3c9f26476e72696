"""Prompt KV shared behind real HTTP (official `openai` client, embedded SmolLM2, CPU float32):
the n samples of a request prefill the prompt once (the others hit its pages, counted by
/metrics) and give what single requests give (greedy and seeded); concurrent first turns of
conversations sharing a system prompt hit the pages of the first one while it still runs; a small
pool under n requests, evictions and client aborts frees everything once idle; and without the
prefix cache n still works, unshared."""

from __future__ import annotations

import asyncio
import time
import uuid

import openai
import pytest
from conftest import SMOLLM2_F32_NO_CACHE, SMOLLM2_F32_SMALL_POOL, ServerProcess

MODEL = "smollm2"
PS = 16  # the default page size
COMMON = ("--model", "smollm2", "--dtype", "float32")


def _system() -> str:
    """A long system prompt no earlier request sent (a fresh nonce): nothing of it is cached."""
    rules = " ".join(f"Rule {k}: be brief, be kind, cite shelf {k} when asked." for k in range(16))
    return f"Session {uuid.uuid4().hex}. You answer questions about the harbour library. {rules}"


@pytest.fixture(scope="module")
def servers(shared_servers):
    """roomy: cache on, a 512-token step budget (without the hold, the leader and a sample would
    prefill in one step); small: 40 pages of 16 (evictions); off: --disable-prefix-cache. small
    and off are the session's shared ones (counters read as deltas, prompts carry nonces)."""
    return shared_servers.get(
        {
            "roomy": (*COMMON, "--max-total-tokens", "16384", "--max-num-batched-tokens", "512"),
            "small": SMOLLM2_F32_SMALL_POOL,
            "off": SMOLLM2_F32_NO_CACHE,
        }
    )


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _tokens(choice) -> list[str]:
    return [t.token for t in choice.logprobs.content]


def _hits(server: ServerProcess) -> tuple[float, float]:
    return (
        server.metric("kvrelay_prefix_cache_hit_tokens_total"),
        server.metric("kvrelay_prefix_cache_query_tokens_total"),
    )


def _idle(server: ServerProcess) -> None:
    """Waits until the engine's stats say nothing runs, waits or holds a page."""
    names = (
        "kvrelay_num_requests_running",
        "kvrelay_num_requests_waiting",
        "kvrelay_kv_pages_used",
    )
    deadline = time.time() + 30
    while time.time() < deadline and any(server.metric(n) for n in names):
        time.sleep(0.2)
    assert {n: server.metric(n) for n in names} == dict.fromkeys(names, 0)


def test_n_greedy_samples_prefill_the_prompt_once_and_equal_one_sample(servers):
    s = servers["roomy"]
    client = _client(s)
    msgs = [{"role": "system", "content": _system()}, {"role": "user", "content": "Hours?"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=12, temperature=0, logprobs=True)
    # A stream decodes meanwhile: the engine is mid-step when the 4 samples arrive, so they
    # reach one step together (an idle engine may start the first alone, which shares anyway).
    background = client.completions.create(
        model=MODEL,
        prompt="Count: 1, 2, 3,",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(background))
    hit0, query0 = _hits(s)
    r = client.chat.completions.create(n=4, **kw)
    hit1, query1 = _hits(s)
    background.close()
    p = r.usage.prompt_tokens
    assert p > 300
    # Once: the first sample computed the prompt, the other three found all its full pages
    # (but the one holding the last prompt token, whose logits each sample needs).
    assert query1 - query0 == 4 * p
    assert hit1 - hit0 == 3 * ((p - 1) // PS) * PS
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # nothing was cached before it
    one = client.chat.completions.create(**kw)
    assert one.usage.prompt_tokens_details.cached_tokens == ((p - 1) // PS) * PS
    assert [_tokens(c) for c in r.choices] == [_tokens(one.choices[0])] * 4
    assert r.usage.completion_tokens == 4 * one.usage.completion_tokens


def test_seeded_n_samples_are_the_seeded_single_requests(servers):
    """Sample i is what a single request seeded seed + i samples, shared prompt or not."""
    client = _client(servers["roomy"])
    prompt = f"Story {uuid.uuid4().hex}: once upon a time, in a harbour library, a keeper"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0)
    r = client.completions.create(n=3, seed=11, **kw)
    singles = [client.completions.create(seed=11 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == singles
    assert len(set(singles)) > 1
    streamed = ["", "", ""]
    for chunk in client.completions.create(n=3, seed=11, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == singles


def test_concurrent_first_turns_sharing_a_system_prompt_hit_while_the_first_runs(servers):
    """8 conversations start at once with one new system prompt: each first turn after the
    first one admitted finds the system prompt's pages cached while the first still decodes
    (before, the pages entered the cache only when a request ended: these all missed)."""
    s, system = servers["roomy"], _system()

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=MODEL,
                        messages=[
                            {"role": "system", "content": system},
                            {"role": "user", "content": f"Visitor {i}: is shelf {i} open?"},
                        ],
                        max_tokens=24,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(8)
                )
            )
        finally:
            await client.close()

    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in asyncio.run(run()))
    assert cached[0] == 0  # the first one computed it
    assert sum(c >= 256 for c in cached) >= 6, cached  # most shared its system prompt


def test_small_pool_with_n_evictions_and_aborts_frees_everything(servers):
    s = servers["small"]
    system = _system()
    evicted0 = s.metric("kvrelay_prefix_cache_evicted_pages_total")

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)

        def msgs(i: int) -> list[dict]:
            return [
                {"role": "system", "content": system if i % 2 else _system()},
                {"role": "user", "content": f"Question {i}?"},
            ]

        async def whole(i: int):
            return await client.chat.completions.create(
                model=MODEL, messages=msgs(i), max_tokens=8, temperature=0, n=4, logprobs=True
            )

        async def aborted(i: int) -> None:
            stream = await client.chat.completions.create(
                model=MODEL, messages=msgs(i), max_tokens=64, temperature=0, n=4, stream=True
            )
            if i % 3:  # some after their first token, the others before anything came
                async for _ in stream:
                    break
            await stream.close()

        try:
            done = await asyncio.gather(*(whole(i) for i in range(4)), *map(aborted, range(6)))
            return done[:4]
        finally:
            await client.close()

    answers = asyncio.run(run())
    _idle(s)
    assert s.metric("kvrelay_prefix_cache_evicted_pages_total") > evicted0  # the pool was short
    for r in answers:  # the 4 greedy samples agree under eviction and preemption
        assert len({tuple(_tokens(c)) for c in r.choices}) == 1
    assert len(answers) == 4


def test_without_the_prefix_cache_n_works_unshared(servers):
    s = servers["off"]
    client = _client(s)
    msgs = [{"role": "system", "content": _system()}, {"role": "user", "content": "Hours?"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True)
    r = client.chat.completions.create(n=3, **kw)
    one = client.chat.completions.create(**kw)
    assert [_tokens(c) for c in r.choices] == [_tokens(one.choices[0])] * 3
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert s.metric("kvrelay_prefix_cache_query_tokens_total") == 0
    _idle(s)
