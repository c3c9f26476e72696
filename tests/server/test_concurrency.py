"""64 concurrent streaming requests of mixed lengths: all finish, each greedy output equals the
same request run alone, and the KV pool is empty afterwards."""

from __future__ import annotations

import asyncio
import random
import time

import openai

MODEL = "smollm2"
TOPICS = [
    "the ocean",
    "a robot",
    "Paris",
    "prime numbers",
    "tea",
    "volcanoes",
    "a lighthouse",
    "jazz",
]


def _requests(n: int = 64) -> list[dict]:
    rng = random.Random(7)
    reqs = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        # Some prompts longer than the server's 128-token prefill chunk.
        filler = " ".join(f"fact {k} about {topic}." for k in range(rng.choice([0, 0, 0, 5, 30])))
        reqs.append(
            dict(
                model=MODEL,
                messages=[
                    {"role": "user", "content": f"{filler} Write about {topic}, variant {i}."}
                ],
                # Mixed, so streams end at different steps (3..12: a request that reads another
                # one's KV rows or positions diverges at its first tokens; the 64 alone runs
                # are most of this test's time, ~40% less decode than with 4..20).
                max_tokens=rng.randint(3, 12),
                temperature=0,
                logprobs=True,
                top_logprobs=2,
            )
        )
    return reqs


async def _stream_one(client: openai.AsyncOpenAI, kw: dict) -> tuple[list[str], list]:
    pieces, lps = [], []
    stream = await client.chat.completions.create(stream=True, **kw)
    async for chunk in stream:
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                lps += ch.logprobs.content
            pieces.append(ch.delta.content or "")
    return pieces, lps


def _first_divergence(a, b) -> int | None:
    for j, (x, y) in enumerate(zip(a, b, strict=False)):
        if x.token != y.token:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def test_64_concurrent_streams_match_alone(server):
    reqs = _requests()
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    alone = [sync.chat.completions.create(**kw) for kw in reqs]

    async def run_all():
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300
        )
        return await asyncio.gather(*(_stream_one(client, kw) for kw in reqs))

    together = asyncio.run(run_all())
    near_ties = 0
    for i, ((pieces, lps), ref) in enumerate(zip(together, alone, strict=True)):
        ref_lps = ref.choices[0].logprobs.content
        j = _first_divergence(lps, ref_lps)
        if j is not None:
            # Allowed only at a genuine numerical near-tie of the reference run.
            top = ref_lps[j].top_logprobs
            gap = top[0].logprob - top[1].logprob
            assert gap < 1e-4, f"request {i} diverged at token {j} with top-2 gap {gap}"
            near_ties += 1
            continue
        assert "".join(pieces) == ref.choices[0].message.content, f"request {i}"
    assert near_ties <= 2
    # Everything freed: no running requests and no KV pages held once the stats settle.
    deadline = time.time() + 10
    while time.time() < deadline and server.metric("kvrelay_kv_pages_used") != 0:
        time.sleep(0.2)
    assert server.metric("kvrelay_kv_pages_used") == 0
    assert server.metric("kvrelay_num_requests_running") == 0


def test_metrics_count_tokens_and_requests(server):
    before = server.metric("kvrelay_generation_tokens_total")
    ttft_before = server.metric("kvrelay_time_to_first_token_seconds_count")
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = sync.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    assert server.metric("kvrelay_generation_tokens_total") - before == r.usage.completion_tokens
    assert server.metric("kvrelay_time_to_first_token_seconds_count") == ttft_before + 1
