"""The router balances by each server's load (router/server_load.py): its own requests in flight
combined with what the server last reported (another router's or a direct client's requests,
queued prompt tokens, a nearly full KV pool); stale reports are ignored. Policy-level tests on
hand-made reports, the probe's parsing and the router's wiring, and the server's prompt backlog."""

from __future__ import annotations

import time

import pytest

from kvrelay.config import RouterConfig
from kvrelay.router.policy import RoutingPolicy, block_hashes
from kvrelay.router.routing import Router
from kvrelay.router.server_load import ReportedLoad, server_load
from kvrelay.server.load_report import PromptBacklog

P = ("http://p1", "http://p2")
PROMPT = block_hashes("the shared system prompt of an agent, repeated. " * 20)


def report(
    running: int = 0,
    waiting: int = 0,
    requests: int = 0,
    queued: int = 0,
    free: int = 1000,
    total: int = 1000,
    age_s: float = 0.0,
) -> ReportedLoad:
    return ReportedLoad(running, waiting, requests, queued, free, total, time.monotonic() - age_s)


def _warm(policy: RoutingPolicy, url: str) -> None:
    """`url` holds PROMPT (a request with it went there and ended)."""
    policy.begin((url,), PROMPT)
    policy.end((url,))


def test_least_load_avoids_a_server_another_client_loaded():
    """p1 runs 3 requests this router never sent: the next 3 go to p2, then they alternate."""
    policy = RoutingPolicy("least_load")
    reported = {"http://p1": report(running=2, waiting=1)}
    picks = []
    for _ in range(5):
        url, _ = policy.choose("prefill", P, [], reported)
        policy.begin((url,), [])
        picks.append(url)
    assert picks[:3] == ["http://p2"] * 3, picks
    assert sorted(picks[3:]) == list(P), picks


def test_reported_and_own_requests_are_not_added():
    """This router's requests are among those the server reports: the larger count, not the sum."""
    assert server_load(4, report(running=3, waiting=1)) == 4
    assert server_load(1, report(running=3, waiting=1)) == 4
    assert server_load(1, report(running=1, requests=5)) == 5  # PD: waiting for KV
    assert server_load(0, report(requests=1, queued=4096)) == 1 + 4
    assert server_load(3, None) == 3


def test_queued_prompt_tokens_weigh_long_prompts():
    policy = RoutingPolicy("least_load")
    reported = {"http://p1": report(waiting=1, queued=16_000), "http://p2": report(waiting=3)}
    assert policy.choose("prefill", P, [], reported)[0] == "http://p2"


def test_cache_aware_leaves_its_cached_server_once_reports_tilt_it():
    """p1 holds the prompt; loaded by others up to 8 requests it keeps it, past that (and 1.5x
    the other) the request goes to p2."""
    policy = RoutingPolicy("cache_aware")
    _warm(policy, "http://p1")
    for running, expected in ((0, "http://p1"), (8, "http://p1"), (9, "http://p2")):
        url, _ = policy.choose("prefill", P, PROMPT, {"http://p1": report(running=running)})
        assert url == expected, (running, url)


def test_stale_reports_are_ignored():
    policy = RoutingPolicy("cache_aware", stale_after_s=5.0)
    _warm(policy, "http://p1")
    stale = {"http://p1": report(running=50, age_s=6.0)}
    assert policy.choose("prefill", P, PROMPT, stale)[0] == "http://p1"
    assert policy.fresh_reports(P, stale) == {}
    fresh = {"http://p1": report(running=50, age_s=1.0)}
    assert policy.choose("prefill", P, PROMPT, fresh)[0] == "http://p2"
    least = RoutingPolicy("least_load", stale_after_s=5.0)
    least.begin(("http://p2",), [])  # in flight here: 1 against a stale 50
    assert least.choose("prefill", P, [], stale)[0] == "http://p1"


def test_a_nearly_full_server_is_avoided():
    """p1's KV pool is nearly full (free below 5%): least_load takes p2 though this router has
    more in flight there; cache_aware leaves p1 though it holds the prompt and runs nothing."""
    full = {"http://p1": report(free=40, total=1000)}
    least = RoutingPolicy("least_load")
    for _ in range(3):
        least.begin(("http://p2",), [])
    assert least.choose("prefill", P, [], full)[0] == "http://p2"
    aware = RoutingPolicy("cache_aware")
    _warm(aware, "http://p1")
    assert aware.choose("prefill", P, PROMPT, full)[0] == "http://p2"
    assert aware.choose("prefill", P, PROMPT, {"http://p1": report(free=60)})[0] == "http://p1"
    both = {u: report(free=1, requests=i) for i, u in enumerate(P)}
    assert least.choose("prefill", P, [], both)[0] == "http://p1"  # all full: by load


def test_report_parsing_takes_counts_only():
    good = dict(running=1, waiting=2, requests=3, queued_prompt_tokens=4, free_pages=5)
    r = ReportedLoad.parse({**good, "total_pages": 6, "extra": "ignored"}, at=7.0)
    assert (r.requests_in_flight, r.free_pages, r.total_pages, r.at) == (3, 5, 6, 7.0)
    for bad in ({**good}, {**good, "total_pages": -1}, {**good, "total_pages": True}, [1]):
        with pytest.raises(ValueError):
            ReportedLoad.parse(bad, at=0.0)


def test_the_router_picks_by_its_probes_reports():
    """Router.pick hands the probe's reports to the policy (no server needed: the views are set)."""
    cfg = RouterConfig(prefill=P, decode=("http://d1", "http://d2"), policy="least_load")
    router = Router(cfg)
    for u in cfg.prefill + cfg.decode:
        router.probe.views[u].ready = True
    router.probe.views["http://p1"].load = report(running=4)
    router.probe.views["http://d2"].load = report(requests=2)
    assert router.pick() == ("http://p2", "http://d1")
    snap = router.probe.snapshot()
    assert snap["http://p1"]["load"]["running"] == 4 and snap["http://d1"]["load"] is None
    assert router.probe.stale_after_s == router.policy.stale_after_s


def test_prompt_backlog_counts_prompts_until_their_first_output():
    b = PromptBacklog()
    b.add("a", 100)
    b.add("b", 30)
    b.add("c", 7)
    assert b.queued_tokens({"a", "b", "c"}) == 137
    b.started("a")
    assert b.queued_tokens({"a", "b", "c"}) == 37
    assert b.queued_tokens({"b"}) == 30  # c released or aborted unseen: forgotten
    assert b.queued_tokens({"b", "c"}) == 30
