"""Cache-aware routing over 2 prefill x 2 decode SmolLM2 servers (real processes): six two-turn
conversations, one after another, through a cache_aware router and a round_robin one at once
(their conversations are distinct). Under cache_aware every second turn goes to the prefill and
the decode of its first (its prefix is cached there: cached_tokens at least half its prompt, and
the prefill servers' hit counters say the same); round robin alternates and sends each second
turn to the other prefill server, whose cache misses."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import start_servers
from pd_stack import PD_SECRET, RouterProcess, engine_threads, metrics

COMMON = ("--model", "smollm2", "--max-total-tokens", "8192", "--pd-secret", PD_SECRET)
HITS = "kvrelay_prefix_cache_hit_tokens_total"


@pytest.fixture(scope="module")
def servers():
    specs = {
        f"{role}{i}": (*COMMON, "--role", role, "--max-num-batched-tokens", "256")
        for role in ("prefill", "decode")
        for i in range(2)
    }
    with engine_threads():
        s = start_servers(specs)
    yield s
    for srv in s.values():
        srv.close()


def _conversation(client: openai.OpenAI, tag: str) -> tuple[int, int]:
    """Two turns; the second turn's (prompt tokens, cached tokens)."""
    msgs = [
        {
            "role": "user",
            "content": f"[{tag}] Here are notes about the lighthouse keeper, who counts ships, "
            "mends nets, and writes the weather into a leather notebook every evening. "
            "Summarise them in one short sentence.",
        }
    ]
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}]
    msgs += [{"role": "user", "content": "Shorter."}]
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4, temperature=0)
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def _prefill_hits(servers) -> float:
    return sum(metrics(servers[f"prefill{i}"].url).get(HITS, 0.0) for i in range(2))


def test_second_turns_land_where_their_prefix_is_cached(servers):
    p = [servers[f"prefill{i}"].url for i in range(2)]
    d = [servers[f"decode{i}"].url for i in range(2)]
    routers = {
        name: RouterProcess(p, d, "--pd-secret", PD_SECRET, "--policy", name)
        for name in ("cache_aware", "round_robin")
    }
    try:
        got = {}
        for name, router in routers.items():
            client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
            before = _prefill_hits(servers)
            turns = [_conversation(client, f"{name} {i}") for i in range(6)]
            got[name] = (turns, _prefill_hits(servers) - before)
            m = httpx.get(router.url + "/metrics", timeout=10).text
            assert "kvrelay_router_matched_blocks_total" in m
        aware, aware_hits = got["cache_aware"]
        assert all(cached >= prompt / 2 for prompt, cached in aware), aware
        assert aware_hits >= sum(prompt for prompt, _ in aware) / 2, (aware_hits, aware)
        rr, rr_hits = got["round_robin"]
        assert rr_hits < aware_hits / 2, (rr_hits, aware_hits)  # the other server: misses
        print(
            f"second-turn prefill hit tokens: cache_aware {aware_hits:.0f}, round_robin {rr_hits:.0f}"
        )
    finally:
        for r in routers.values():
            r.close()
