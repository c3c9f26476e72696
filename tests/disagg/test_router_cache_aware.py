"""Cache-aware routing over 2 prefill x 2 decode SmolLM2 servers (real processes): six two-turn
conversations, one after another, through a cache_aware router and a round_robin one at once
(their conversations are distinct). Under cache_aware every second turn goes to the prefill and
the decode of its first (its prefix is cached there: cached_tokens at least half its prompt, and
the prefill servers' hit counters say the same); round robin alternates and sends each second
turn to the other prefill server, whose cache misses. Load reports (`GET /load`) on the same
servers: a decode server running a request another router sent reports it, a second router's
probe sees it, and that router's least_load sends its next request to the other decode."""

from __future__ import annotations

import time
from collections.abc import Callable

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


def _wait_for(what: str, probe: Callable[[], object], timeout_s: float = 60.0):
    """`probe()`'s first truthy value, asked until `timeout_s` (generous: no timing asserted)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := probe():
            return got
        time.sleep(0.1)
    raise AssertionError(f"not seen within {timeout_s}s: {what}")


def _finished(url: str) -> float:
    return sum(v for k, v in metrics(url).items() if k.startswith("kvrelay_requests_total{"))


def test_load_reports_reach_another_routers_policy(servers):
    """A long request through router A runs on one decode server: that server's /load reports
    it, router B's probe shows it, and B (least_load, nothing in flight of its own) sends its
    next request to the other decode server."""
    p = [servers[f"prefill{i}"].url for i in range(2)]
    d = [servers[f"decode{i}"].url for i in range(2)]
    a = RouterProcess(p, d, "--pd-secret", PD_SECRET, "--policy", "round_robin")
    b = RouterProcess(p, d, "--pd-secret", PD_SECRET, "--policy", "least_load")
    long_body = {
        "model": "smollm2",
        "prompt": "Count the ships in the harbour, one per line: " * 4,
        "max_tokens": 4000,  # runs until the stream is closed (aborted) below
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    try:
        with httpx.stream("POST", a.url + "/v1/completions", json=long_body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped generator would close the stream
            next(lines)  # the first token: the request runs on a decode server
            busy = _wait_for(
                "a decode server's /load reporting a running request",
                lambda: [u for u in d if httpx.get(u + "/load").json()["running"] >= 1],
            )[0]
            idle = d[1 - d.index(busy)]
            load = httpx.get(busy + "/load").json()
            assert load["requests"] >= 1 and load["queued_prompt_tokens"] == 0, load
            assert 0 < load["free_pages"] < load["total_pages"], load
            seen = _wait_for(
                "router B's probe showing the busy decode server's report",
                lambda: (
                    (s := httpx.get(b.url + "/ready").json()["servers"][busy]["load"])
                    and s["running"] >= 1
                    and s
                ),
            )
            assert seen["total_pages"] == load["total_pages"] and seen["age_s"] >= 0, seen
            before = {u: _finished(u) for u in d}
            client = openai.OpenAI(base_url=b.url + "/v1", api_key="x", max_retries=0)
            client.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
            _wait_for("B's request counted", lambda: _finished(idle) > before[idle])
            assert _finished(busy) == before[busy]  # the long one still runs there
            assert next(lines) is not None  # its stream is still open
        # The stream closed: the long request is aborted; the servers are idle again.
        _wait_for(
            "the decode servers idle",
            lambda: all(httpx.get(u + "/load").json()["requests"] == 0 for u in d),
        )
    finally:
        a.close()
        b.close()
