"""PD decode's own prefix cache (engines in one process, tiny dummy model, real TCP): a turn whose
prompt begins with what decode already holds is sent only from there on (exact byte counts), and
decodes the very tokens of a single engine; a decode without the cache, or whose cache was
emptied in between, gets the whole prompt; a skip decode should never ask for is refused."""

from __future__ import annotations

import pytest
from engine_pair import PARAMS, pairs
from engine_pair import dense_engine as _engine

from kvrelay.disagg.protocol import Cause
from kvrelay.engine.engine import Engine, generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend

SYSTEM = [(13 * j) % 900 + 30 for j in range(40)]  # shared by every conversation: 2.5 pages


def _user(i: int, turn: int) -> list[int]:
    return [(7 * i + 11 * turn + 3 * j) % 900 + 50 for j in range(10)]


@pytest.fixture(scope="module")
def single() -> Engine:
    return _engine("single")


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def _turn(pair, prompts: list[list[int]], tag: str) -> list[list[int]]:
    """Every prompt through PD at once; returns decode's outputs per prompt."""
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts, strict=True):
        pair.submit(rid, ids)
    pair.pump(lambda: all(pair.finished("decode", r) and pair.finished("prefill", r) for r in rids))
    return [pair.outs[("decode", r)] for r in rids]


def _sent_bytes(pair) -> int:
    """KV bytes prefill has sent since it started."""
    return pair.p.agent.take_stats()[0].get("sent", {}).get("tcp", 0)


def _conversations(pair, single, n: int, flush: bool = False) -> tuple[int, int, list]:
    """n two-turn conversations, each turn sent concurrently; turn 2 = turn 1 + its answer + a
    new user message (72 tokens). Returns the bytes each turn moved and turn 2's outputs."""
    first = [SYSTEM + _user(i, 1) for i in range(n)]  # 50 tokens
    outs1 = _turn(pair, first, "t1")
    bytes1 = _sent_bytes(pair)
    if flush:  # decode's cache emptied between the turns (evicted under pressure, say)
        pair.d.flush_prefix_cache()
    second = [
        p + _tokens(o) + _user(i, 2) for i, (p, o) in enumerate(zip(first, outs1, strict=True))
    ]
    want = generate(single, second, PARAMS)
    outs2 = _turn(pair, second, "t2")
    for got, w in zip(outs2, want, strict=True):
        assert _tokens(got) == _tokens(w)
        lp = [x for o in got for x in o.logprobs]
        assert lp == pytest.approx([x for o in w for x in o.logprobs], abs=1e-4)
    bytes2 = _sent_bytes(pair) - bytes1
    pair.assert_clean()
    return bytes1, bytes2, outs2


@pytest.mark.parametrize("n", [1, 8])
def test_a_second_turn_moves_only_what_decode_does_not_hold(single, n: int) -> None:
    with pairs() as make:
        pair = make(_engine("prefill"), _engine("decode"))
        row = sum(k.row_bytes for k in pair.d.agent.kinds)  # one token's KV, every layer
        bytes1, bytes2, outs2 = _conversations(pair, single, n)
        # Turn 1: all reserved before any arrived, so nothing to share: 50 tokens each.
        assert bytes1 == n * 50 * row
        # Turn 2: decode cached turn 1's 61 computed tokens as 3 full pages (48 tokens): only
        # tokens 48..71 move.
        assert bytes2 == n * (72 - 48) * row
        assert pair.d.scheduler.prefix.hit_tokens == n * 48
        assert {o[0].num_cached_tokens for o in outs2} == {48}  # usage: prefill's hit agrees


def test_decode_without_prefix_cache_gets_every_token(single) -> None:
    with pairs() as make:
        pair = make(_engine("prefill"), _engine("decode", prefix_cache=False))
        assert pair.d.prefix_cache == "off (--disable-prefix-cache)"
        row = sum(k.row_bytes for k in pair.d.agent.kinds)
        bytes1, bytes2, outs2 = _conversations(pair, single, 1)
        assert (bytes1, bytes2) == (50 * row, 72 * row)
        assert {o[0].num_cached_tokens for o in outs2} == {48}  # prefill still reused its own


def test_decode_whose_cache_was_emptied_in_between_gets_every_token(single) -> None:
    with pairs() as make:
        pair = make(_engine("prefill"), _engine("decode"))
        row = sum(k.row_bytes for k in pair.d.agent.kinds)
        _, bytes2, _ = _conversations(pair, single, 1, flush=True)
        assert bytes2 == 72 * row


@pytest.mark.parametrize("skip", [8, 64], ids=["mid_page", "past_the_prompt"])
def test_prefill_refuses_a_skip_decode_could_not_mean(skip: int) -> None:
    """A decode that asks prefill to skip part of a page, or the whole prompt, is a broken
    peer: prefill fails the transfer (identity) instead of leaving holes in decode's KV."""
    with pairs() as make:
        pair = make(_engine("prefill"), _engine("decode"))
        d_sched = pair.d.scheduler
        reserve = d_sched.reserve_transfer

        def lying_reserve(req) -> None:
            reserve(req)
            req.matched_tokens = skip

        d_sched.reserve_transfer = lying_reserve
        ids = SYSTEM + _user(0, 1)  # 50 tokens
        pair.submit("x", ids)
        pair.pump(lambda: pair.finished("prefill", "x") and pair.finished("decode", "x"))
        p_out = pair.last("prefill", "x")
        assert p_out.cause == Cause.IDENTITY and "skip" in p_out.error
        assert pair.last("decode", "x").error
        d_sched.reserve_transfer = reserve
        pair.assert_clean()
