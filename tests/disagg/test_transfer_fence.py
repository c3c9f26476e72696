"""The fence: decode never hands a failed transfer's pages to another request while its prefill
may still write into them, so a late write cannot change another request's KV.

Real engines over real TCP, in one process. Two prefills share one decode: X (prefill 1) is
aborted on decode after its reservation was acknowledged, Y (prefill 2) is transferred and starts
decoding, then prefill 1 - which has not yet read decode's abort - computes X and sends its KV.
In place (as cuda_ipc does, here into decode's tensors shared in-process) that write lands in the
pages decode reserved for X; over TCP its pieces arrive after the abort. Either way Y's tokens and
logprobs must be those of a single engine, and X's pages come back once prefill says it stopped.
"""

from __future__ import annotations

import time

import pytest
from engine_pair import PARAMS, PD_SECRET, pairs
from engine_pair import dense_engine as _engine
from fake_peer import FakePeer, authenticate_as_prefill

from kvrelay.disagg import protocol as P
from kvrelay.disagg.protocol import Cause, TState
from kvrelay.disagg.transport.in_place import InPlaceIntake, InPlaceLink
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import AddRequest, PDParams

X_IDS = [(11 * j) % 900 + 40 for j in range(30)]  # one prefill chunk (budget 32)
Y_IDS = [(5 * j + 3) % 900 + 20 for j in range(30)]  # the same rows, other KV


def _submit(p: Engine, d: Engine, rid: str, ids: list[int]) -> None:
    tid = f"t-{rid}"
    d.add(AddRequest(rid, ids, PARAMS, PDParams("decode", tid)))
    p.add(AddRequest(rid, ids, PARAMS, PDParams("prefill", tid, d.agent.addr, d.agent.instance_id)))


def _pump(engines: dict[str, Engine], outs: dict, done, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not done():
        assert time.time() < deadline, f"no progress: {outs}"
        for name, e in engines.items():
            e.poll_transfers()
            if e.has_work:
                for o in e.step().outputs:
                    outs.setdefault((name, o.rid), []).append(o)
        time.sleep(0.001)


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def _share_in_place(p: Engine, d: Engine) -> None:
    """From now on prefill writes rows straight into decode's cache tensors, as it does over
    CUDA IPC (in one process the tensors themselves are shared; only headers go over TCP)."""
    shared = {k.name: k.byte_rows for k in d.agent.kinds}
    checksum = p.agent.cfg.checksum
    peer = p.agent.peers[d.agent.addr]
    peer.link = InPlaceLink(shared, p.agent.kinds, p.runner.page_size, checksum)
    d.agent.intakes[True] = InPlaceIntake(checksum)


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "tcp"])
def test_late_write_of_an_aborted_transfer_leaves_the_next_owner_alone(in_place: bool) -> None:
    want = generate(_engine("single"), [Y_IDS], PARAMS)[0]
    p1, p2, d = _engine("prefill"), _engine("prefill"), _engine("decode")
    every = {"p1": p1, "p2": p2, "d": d}
    outs: dict = {}

    def finished(side: str, rid: str) -> bool:
        return any(o.finish_reason for o in outs.get((side, rid), []))

    with pairs() as make:
        make(p1, d), make(p2, d)  # closes the agents after
        for side in ("p1", "p2"):  # both prefills connected (and their transfers working) first
            _submit(every[side], d, f"warm-{side}", X_IDS)
            _pump(
                every, outs, lambda s=side: finished("d", f"warm-{s}") and finished(s, f"warm-{s}")
            )
        if in_place:
            _share_in_place(p1, d)

        _submit(p1, d, "x", X_IDS)
        t_x = p1.agent.transfers["x"]
        while t_x.sm.state != TState.PREFILLING:  # acknowledged, not yet computed on prefill 1
            p1.poll_transfers()
            d.poll_transfers()
            time.sleep(0.001)
        # decode's own pages for X: the page it shares with the warm-up's cached X is never
        # written by prefill (it skips those tokens), so only the rest is fenced
        assert t_x.skip == 16
        x_pages = list(t_x.dst_pages)[t_x.skip // 16 :]
        d.abort("x")  # decode's Failure is on its way; prefill 1 does not read it yet
        assert d.agent.state_counts()["fenced"] == 1
        assert set(x_pages) <= {p for f in d.scheduler.fences for p in f.pages}

        _submit(p2, d, "y", Y_IDS)
        pair2 = {"p2": p2, "d": d}
        _pump(pair2, outs, lambda: len(_tokens(outs.get(("d", "y"), []))) >= 3)
        y = d.scheduler.find("y")
        assert y is not None and not set(y.pages) & set(x_pages)  # fenced pages stay out

        p1.step()  # computes X and sends its KV: the late write, after Y's KV is installed
        assert t_x.sm.state == TState.SENDING and t_x.pieces > 0

        _pump(every, outs, lambda: finished("d", "y") and finished("p1", "x"))
        _pump(
            every,
            outs,
            lambda: not any(e.transfers_in_flight or e.has_work for e in every.values()),
        )

    got = outs[("d", "y")]
    assert _tokens(got) == _tokens(want)
    lp = [x for o in got for x in o.logprobs]
    assert lp == pytest.approx([x for o in want for x in o.logprobs], abs=1e-4)
    assert outs[("d", "x")][-1].finish_reason == "abort"
    assert outs[("p1", "x")][-1].cause == Cause.PEER_FAILED  # told by decode, then Released
    assert not d.scheduler.fences and d.agent.state_counts()["fenced"] == 0
    for e in every.values():
        e.check_idle_integrity()
        e.flush_prefix_cache()  # what the prefix cache alone holds
        assert e.scheduler.page_pool.num_used == 0


def test_a_prefill_that_never_releases_is_hung_up_on_before_its_pages_go_back() -> None:
    """A peer that does not answer decode's Failure with Released (a raw socket here) keeps the
    pages fenced; after bootstrap_timeout_s decode closes its connection, and only then are the
    pages free (nothing can arrive on a closed connection)."""
    d = _engine("decode", bootstrap_timeout_s=0.5)
    peer = FakePeer.connect(d.agent.addr)
    try:
        authenticate_as_prefill(peer, d, PD_SECRET)
        d.add(AddRequest("f", X_IDS, PARAMS, PDParams("decode", "t-f")))
        peer.send(P.ReserveRequest("t-f", "f", len(X_IDS), P.prompt_hash(X_IDS)))
        t, deadline = d.agent.transfers["t-f"], time.time() + 5
        while t.sm.state != TState.RECEIVING:  # decode matches it on its engine thread (here)
            assert time.time() < deadline, "decode never matched the reservation"
            d.poll_transfers()
            time.sleep(0.001)
        ack = peer.recv()
        assert isinstance(ack, P.ReserveAck) and ack.ok and ack.pages
        d.abort("f")
        failure = peer.recv()
        assert isinstance(failure, P.Failure) and failure.cause == Cause.ABORTED
        d.poll_transfers()
        assert d.agent.state_counts()["fenced"] == 1
        assert d.scheduler.page_pool.num_used == len(ack.pages)  # held while it may write
        deadline = time.time() + 5
        while d.agent.fences:
            assert time.time() < deadline, "the fence never timed out"
            d.poll_transfers()
            time.sleep(0.01)
        d.flush_prefix_cache()  # what the prefix cache alone holds
        assert d.scheduler.page_pool.num_used == 0
        d.check_idle_integrity()
        assert peer.hung_up()
    finally:
        peer.close()
        d.agent.close()
