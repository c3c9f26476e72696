"""The router's routing policies (router/policy.py) on simulated traffic: cache_aware
sends a conversation's next turn where its earlier turns went (round robin would, for two
servers, about half the time), spreads requests sharing one system prompt once the load would
tilt, and forgets what it sent past its bound; the prefix hashes are prefixes."""

from __future__ import annotations

import random

import pytest

from kvrelay.router.policy import (
    BLOCK_CHARS,
    RoutingPolicy,
    ServerMemory,
    block_hashes,
    prompt_text,
)

P = ("http://p1", "http://p2")
D = ("http://d1", "http://d2")
SYSTEM = {"role": "system", "content": "You are a careful agent. " * 20}


def _turns(conv: int, n: int) -> list[dict]:
    """The request bodies of conversation `conv`'s first n turns (each resends the history)."""
    msgs, bodies = [SYSTEM], []
    for t in range(n):
        msgs = [*msgs, {"role": "user", "content": f"conversation {conv} question {t} " * 8}]
        bodies.append({"model": "m", "messages": list(msgs)})
        msgs = [*msgs, {"role": "assistant", "content": f"answer {conv}.{t} " * 10}]
    return bodies


def _route(policy: RoutingPolicy, body: dict) -> tuple[str, str]:
    h = block_hashes(prompt_text(body))
    p, _ = policy.choose("prefill", P, h)
    d, _ = policy.choose("decode", D, h)
    policy.begin((p, d), h)
    return p, d


@pytest.mark.parametrize("name", ["cache_aware", "round_robin"])
def test_later_turns_follow_their_conversation(name):
    """16 conversations x 3 turns, turns of different conversations interleaved at random
    (concurrency 4: a request ends four requests after it started)."""
    rng = random.Random(0)
    policy = RoutingPolicy(name)
    queue = [(c, t) for c in range(16) for t in range(3)]
    order, pending = [], {c: 0 for c in range(16)}
    while any(v < 3 for v in pending.values()):
        c = rng.choice([c for c, v in pending.items() if v < 3])
        order.append((c, pending[c]))
        pending[c] += 1
    assert sorted(order) == sorted(queue)
    first, followed, later, inflight = {}, 0, 0, []
    for c, t in order:
        pair = _route(policy, _turns(c, t + 1)[t])
        inflight.append(pair)
        if len(inflight) > 4:
            policy.end(inflight.pop(0))
        if t == 0:
            first[c] = pair
        else:
            later += 1
            followed += pair == first[c]
    share = followed / later
    if name == "cache_aware":
        assert share == 1.0, share
    else:
        assert share < 0.75, share


def test_a_shared_system_prompt_spreads_once_load_tilts():
    """40 first turns in flight at once, all sharing SYSTEM (more than half of each prompt):
    they go to the server holding it until the load tilts (8 more in flight), then one goes to
    the other, which from then on holds SYSTEM too: the rest spread by load."""
    policy = RoutingPolicy("cache_aware")
    for c in range(40):
        _route(policy, _turns(100 + c, 1)[0])
    loads = [policy.inflight[u] for u in P]
    assert sum(loads) == 40 and max(loads) - min(loads) <= 8 + 1, loads
    h = block_hashes(prompt_text(_turns(0, 1)[0]))
    assert all(policy.memory[u].matched(h) > 0 for u in P)  # both learnt SYSTEM


def test_least_load_picks_the_idlest_and_balance_holds():
    policy = RoutingPolicy("least_load")
    for c in range(10):
        _route(policy, _turns(c, 1)[0])
    assert [policy.inflight[u] for u in P] == [5, 5]
    policy.end(("http://p2",))
    h = block_hashes(prompt_text(_turns(0, 1)[0]))
    assert policy.choose("prefill", P, h)[0] == "http://p2"


def test_chained_hashes_are_prefixes_and_a_changed_block_changes_all_later():
    a = "x" * (BLOCK_CHARS * 4)
    b = a[:BLOCK_CHARS] + "y" + a[BLOCK_CHARS + 1 :]
    ha, hb = block_hashes(a), block_hashes(b)
    assert (
        len(ha) == 4 and ha[0] == hb[0] and all(x != y for x, y in zip(ha[1:], hb[1:], strict=True))
    )
    assert block_hashes(a + "tail" * 40)[:4] == ha
    t1, t2 = (prompt_text(b) for b in _turns(7, 2))
    assert t2.startswith(t1[: len(t1) - len(t1) % BLOCK_CHARS])
    assert prompt_text({"prompt": [[1, 2, 3], [4]]}) == "1,2,3"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"


def test_memory_forgets_the_least_recently_used_past_its_bound():
    m = ServerMemory(max_blocks=8)
    old, new = block_hashes("a" * BLOCK_CHARS * 6), block_hashes("b" * BLOCK_CHARS * 6)
    m.remember(old)
    m.remember(new)
    assert len(m.blocks) == 8 and m.matched(new) == 6 and m.matched(old) == 0


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown routing policy"):
        RoutingPolicy("random")
