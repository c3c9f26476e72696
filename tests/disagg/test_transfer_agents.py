"""Prefill and decode engines in one process (tiny dummy model), talking over real TCP.

Fast checks of the transfer logic: PD == single engine token for token, and every failure path
(corrupt bytes, identity mismatch, no room on decode, timeouts, aborts, a lost peer) ends with an
error naming its cause on both sides and every KV page back in the free list.
"""

from __future__ import annotations

import time

import pytest
from engine_pair import Pair, pairs
from engine_pair import dense_engine as _engine

from kvrelay.disagg import protocol as P
from kvrelay.disagg.protocol import Cause
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def _prompts() -> list[list[int]]:
    return [
        [(7 * i + 3 * j) % 1000 + 10 for j in range(n)]
        for i, n in enumerate([5, 16, 17, 33, 70, 100])
    ]


@pytest.fixture(scope="module")
def single() -> Engine:
    return _engine("single")


@pytest.fixture
def make_pair():
    """Builds prefill/decode pairs; closes their transfer agents (sockets, heartbeat threads) after."""
    with pairs() as make:
        yield make


@pytest.fixture
def pair(make_pair):
    return make_pair(_engine("prefill"), _engine("decode"))


def test_pd_equals_single_engine(pair, single):
    prompts = _prompts()
    want = generate(single, prompts, PARAMS)
    for i, ids in enumerate(prompts):
        pair.submit(f"r{i}", ids)
    rids = [f"r{i}" for i in range(len(prompts))]
    pair.pump(lambda: all(pair.finished("decode", r) and pair.finished("prefill", r) for r in rids))
    for rid, w in zip(rids, want, strict=True):
        got = pair.outs[("decode", rid)]
        assert [t for o in got for t in o.token_ids] == [t for o in w for t in o.token_ids], rid
        lp_got = [x for o in got for x in o.logprobs]
        lp_want = [x for o in w for x in o.logprobs]
        assert lp_got == pytest.approx(lp_want, abs=1e-4), rid
        top_got = [[a.token_id for a in x] for o in got for x in o.top_logprobs]
        assert top_got == [[a.token_id for a in x] for o in w for x in o.top_logprobs]
        assert got[-1].finish_reason == "length" and got[-1].error is None
        assert pair.last("prefill", rid).finish_reason == "transferred"
    pair.assert_clean()
    # What /metrics gets: the prompts' KV bytes on both sides, two timings per transfer per side.
    want_bytes = sum(map(len, prompts)) * sum(k.row_bytes for k in pair.d.agent.kinds)
    p_bytes, p_events, p_timings = pair.p.agent.take_stats()
    d_bytes, d_events, d_timings = pair.d.agent.take_stats()
    assert p_bytes == {"sent": {"tcp": want_bytes}} and d_bytes == {
        "installed": {"tcp": want_bytes}
    }
    assert sorted({(s, p) for s, p, _ in p_timings + d_timings}) == [
        ("decode", "install"), ("decode", "transfer"), ("prefill", "send"), ("prefill", "transfer")
    ]  # fmt: skip
    assert len(p_timings) == len(d_timings) == 2 * len(prompts)
    assert p_events == d_events == {"peer_connected": 1}
    assert pair.p.agent.take_stats()[2] == []  # timings are handed over once


def test_kv_goes_to_decode_chunk_by_chunk_as_prefill_computes_it(pair, single):
    ids = _prompts()[5]  # 100 tokens: prefill chunks of 32, 32, 32, 4
    want = generate(single, [ids], PARAMS)[0]
    pair.submit("k1", ids)
    sent, pieces = [], 0

    def progress() -> bool:
        nonlocal pieces
        t = pair.p.agent.transfers.get("k1")
        if t is not None:
            if t.sm.state.value == "prefilling" and t.sent not in sent:
                sent.append(t.sent)  # KV already on its way while later chunks still compute
            pieces = t.pieces
        return pair.finished("decode", "k1")

    pair.pump(progress)
    assert sent == [0, 32, 64]  # (96 goes out at the step that computes the last 4 tokens)
    assert pieces == 4 * pair.d.src.config.num_layers  # one piece per chunk and layer group
    got = pair.outs[("decode", "k1")]
    assert [t for o in got for t in o.token_ids] == [t for o in want for t in o.token_ids]
    pair.assert_clean()


def test_seeded_sampling_continues_as_in_one_engine(pair, single):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    ids = _prompts()[4]
    want = [t for o in generate(single, [ids], params)[0] for t in o.token_ids]
    pair.submit("s1", ids, params)
    pair.pump(lambda: pair.finished("decode", "s1"))
    assert [t for o in pair.outs[("decode", "s1")] for t in o.token_ids] == want
    pair.assert_clean()


def _assert_failed(pair: Pair, rid: str, side: str, cause: str) -> None:
    o = pair.last(side, rid)
    assert o.finish_reason == "error" and o.cause == cause, (side, o)
    assert cause in o.error


def test_corrupt_bytes_are_never_installed(make_pair):
    pr = make_pair(_engine("prefill", test_corrupt_p=1.0), _engine("decode"))
    pr.submit("c1", _prompts()[4])
    pr.pump(lambda: pr.finished("decode", "c1") and pr.finished("prefill", "c1"))
    _assert_failed(pr, "c1", "decode", Cause.CHECKSUM)
    _assert_failed(pr, "c1", "prefill", Cause.CHECKSUM)  # decode's failure message names the cause
    assert all(not o.token_ids for o in pr.outs[("decode", "c1")])
    pr.assert_clean()


def test_checksum_off_is_honoured_on_both_sides(make_pair):
    pr = make_pair(_engine("prefill", checksum=False), _engine("decode", checksum=False))
    pr.submit("n1", _prompts()[3])
    pr.pump(lambda: pr.finished("decode", "n1") and pr.finished("prefill", "n1"))
    assert pr.last("decode", "n1").finish_reason == "length"
    pr.assert_clean()


def test_prompt_mismatch_is_an_identity_error(pair):
    ids = _prompts()[3]
    pair.submit("m1", ids, d_ids=ids[:-1] + [ids[-1] + 1])
    pair.pump(lambda: pair.finished("decode", "m1") and pair.finished("prefill", "m1"))
    _assert_failed(pair, "m1", "decode", Cause.IDENTITY)
    _assert_failed(pair, "m1", "prefill", Cause.REFUSED)
    pair.assert_clean()


def test_no_room_on_decode_refuses_before_prefill_computes(make_pair):
    pr = make_pair(_engine("prefill"), _engine("decode", max_total_tokens=128))
    ids = _prompts()[5]  # 100 prompt tokens + 12 new: 7 of decode's 8 pages
    pr.submit("hold", ids, send_prefill=False)  # reserved on decode, its prefill not sent yet
    pr.submit("big", ids, tid="t-big")
    pr.pump(lambda: pr.finished("decode", "big") and pr.finished("prefill", "big"))
    _assert_failed(pr, "big", "decode", Cause.NO_KV)
    _assert_failed(pr, "big", "prefill", Cause.REFUSED)
    assert "KV cache full" in pr.last("prefill", "big").error
    assert pr.p.stats().num_preemptions == 0 and not pr.outs.get(("prefill", "hold"))
    pr.d.abort("hold")
    pr.assert_clean()


def test_request_rejected_by_decode_is_refused_to_prefill_at_once(make_pair):
    pr = make_pair(_engine("prefill"), _engine("decode", max_total_tokens=64))
    pr.submit("long", _prompts()[5])  # 100 + 12 tokens: over decode's 64-token context
    pr.pump(lambda: pr.finished("decode", "long") and pr.finished("prefill", "long"), timeout=5)
    assert pr.last("decode", "long").finish_reason == "rejected"
    _assert_failed(pr, "long", "prefill", Cause.REFUSED)
    assert "context length" in pr.last("prefill", "long").error
    pr.assert_clean()


def test_prefill_that_never_comes_times_out_on_decode(make_pair):
    pr = make_pair(_engine("prefill"), _engine("decode", bootstrap_timeout_s=0.3))
    pr.submit("lonely", _prompts()[2], send_prefill=False)
    pr.pump(lambda: pr.finished("decode", "lonely"), timeout=5)
    _assert_failed(pr, "lonely", "decode", Cause.TIMEOUT)
    pr.assert_clean()


def test_decode_that_never_gets_the_request_refuses_prefill(make_pair):
    pr = make_pair(_engine("prefill"), _engine("decode", bootstrap_timeout_s=0.3))
    pr.submit("orphan", _prompts()[2], send_decode=False)
    pr.pump(lambda: pr.finished("prefill", "orphan"), timeout=5)
    _assert_failed(pr, "orphan", "prefill", Cause.REFUSED)
    pr.assert_clean()


def test_abort_on_decode_fails_prefill_side(pair):
    pair.submit("a1", _prompts()[5], send_prefill=False)
    pair.pump(lambda: pair.d.transfers_in_flight)
    pair.submit("a1", _prompts()[5], send_decode=False)
    pair.pump(lambda: pair.p.agent.transfers["a1"].sm.state.value != "bootstrapping")
    pair.d.abort("a1")
    pair.pump(lambda: pair.finished("prefill", "a1") and pair.finished("decode", "a1"))
    assert pair.last("decode", "a1").finish_reason == "abort"
    _assert_failed(pair, "a1", "prefill", Cause.PEER_FAILED)
    pair.assert_clean()


def test_lost_decode_fails_prefill_requests_at_once(make_pair):
    pr = make_pair(_engine("prefill"), _engine("decode"))
    pr.submit("l1", _prompts()[5], send_decode=False)  # waits as an orphan on decode
    pr.pump(lambda: not pr.d.agent.events.empty() or pr.d.agent.orphans)
    pr.d.agent.close()  # decode's transfer agent goes away
    pr.pump(lambda: pr.finished("prefill", "l1"), timeout=5)
    _assert_failed(pr, "l1", "prefill", Cause.PEER_LOST)
    pr.p.flush_prefix_cache()  # what the prefix cache alone holds
    assert pr.p.scheduler.page_pool.num_used == 0


def test_silent_peer_is_dropped_by_heartbeat_timeout(make_pair):
    hb = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=3.0)
    pr = make_pair(_engine("prefill", **hb), _engine("decode", **hb))
    pr.d.agent.heartbeats_paused = True  # decode's host goes quiet; its socket stays open
    pr.submit("h1", _prompts()[2], send_decode=False)  # prefill waits for a reservation ack forever
    pr.pump(lambda: pr.finished("prefill", "h1"), timeout=20)
    _assert_failed(pr, "h1", "prefill", Cause.PEER_LOST)
    pr.pump(lambda: not pr.d.agent.orphans, timeout=5)  # decode saw the close: the orphan is gone


def test_heartbeats_keep_an_idle_connection_alive(make_pair):
    hb = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=3.0)
    pr = make_pair(_engine("prefill", **hb), _engine("decode", **hb))
    pr.submit("k1", _prompts()[1])
    pr.pump(lambda: pr.finished("decode", "k1") and pr.finished("prefill", "k1"))
    conn = pr.p.agent.peers[pr.d.agent.addr].conn
    time.sleep(7.0)  # idle for over twice the timeout: heartbeats must carry it
    assert not conn.closed
    pr.submit("k2", _prompts()[1])
    pr.pump(lambda: pr.finished("decode", "k2") and pr.finished("prefill", "k2"))
    assert pr.p.agent.peers[pr.d.agent.addr].conn is conn
    pr.assert_clean()


def test_a_handshake_slower_than_the_heartbeat_interval_still_connects(make_pair):
    # A loaded decode answers the hello late. Prefill must not ping a connection decode has not
    # authenticated yet: decode refuses any frame but the handshake's there and hangs up (this
    # failed every first request of a loaded pair whose handshake outlasted one interval).
    hb = dict(heartbeat_interval_s=0.05, heartbeat_timeout_s=3.0)
    pr = make_pair(_engine("prefill", **hb), _engine("decode", **hb))
    answer = pr.d.agent._on_handshake

    def slow(conn, msg):
        if isinstance(msg, P.Hello):
            time.sleep(0.5)  # ten heartbeat intervals
        answer(conn, msg)

    pr.d.agent._on_handshake = slow
    pr.submit("s1", _prompts()[1])
    pr.pump(lambda: pr.finished("decode", "s1") and pr.finished("prefill", "s1"))
    for side in ("prefill", "decode"):
        assert pr.last(side, "s1").error is None, pr.outs
    assert pr.d.agent.bootstrap_counts.get("peer_unauthenticated", 0) == 0
    pr.assert_clean()


def test_profiled_prefill_step_times_its_kv_send(make_pair):
    pr = make_pair(_engine("prefill"), _engine("decode"))
    pr.p.profile_every = 1
    pr.submit("p1", _prompts()[4])  # 70 tokens: chunks of 32, 32, 6
    splits = []
    deadline = time.time() + 20
    while not pr.finished("decode", "p1"):
        assert time.time() < deadline
        for side, e in (("prefill", pr.p), ("decode", pr.d)):
            e.poll_transfers()
            if e.has_work:
                step = e.step()
                if side == "prefill" and step.stats.batch_size:
                    splits.append(step.stats.components)
                for o in step.outputs:
                    pr.outs.setdefault((side, o.rid), []).append(o)
    # The first chunks' KV leaves between steps; the last chunk's step ships the rest and the
    # first token to decode inside the step: that is its communication.
    assert len(splits) == 3
    assert [s["communication"] > 0 for s in splits] == [False, False, True]
    assert all(s["attention"] > 0 and s["mlp"] > 0 for s in splits)
    pr.assert_clean()
