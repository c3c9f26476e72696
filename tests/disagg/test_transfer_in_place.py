"""The in-place way a piece can travel (cuda_ipc's: prefill writes the rows into decode's pages,
only the header goes over the connection), on CPU: in one process the link is given decode's
tensors themselves. PD then equals a single engine, the bytes count as cuda_ipc's, a piece
damaged where decode reads it is a checksum error, and an in-place piece to a decode that shares
no memory an identity error; every page comes back."""

from __future__ import annotations

import pytest
from engine_pair import PARAMS, Pair, pairs
from engine_pair import dense_engine as _engine

from kvrelay.disagg.faults import SendFaults
from kvrelay.disagg.protocol import Cause
from kvrelay.disagg.transport.in_place import InPlaceIntake, InPlaceLink
from kvrelay.engine.engine import generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend

PROMPTS = [[(7 * i + 3 * j) % 1000 + 10 for j in range(n)] for i, n in enumerate([17, 40, 70])]


def _connected(pr: Pair) -> None:
    """One transfer first: prefill's peer for this decode exists (and has authenticated)."""
    pr.submit("warm", PROMPTS[0])
    pr.pump(lambda: pr.finished("decode", "warm") and pr.finished("prefill", "warm"))


def _share(pr: Pair, decode_accepts: bool = True) -> None:
    checksum = pr.p.agent.cfg.checksum
    shared = {k.name: k.byte_rows for k in pr.d.agent.kinds}
    peer = pr.p.agent.peers[pr.d.agent.addr]
    peer.link = InPlaceLink(shared, pr.p.agent.kinds, pr.p.runner.page_size, checksum)
    if decode_accepts:
        pr.d.agent.intakes[True] = InPlaceIntake(checksum)


@pytest.fixture
def make_pair():
    with pairs() as make:
        yield make


def test_in_place_pd_equals_single_engine(make_pair):
    want = generate(_engine("single"), PROMPTS, PARAMS)
    pr = make_pair(_engine("prefill", prefix_cache=False), _engine("decode", prefix_cache=False))
    _connected(pr)
    _share(pr)
    sent_before = pr.p.agent.take_stats()[0]["sent"].get("cuda_ipc", 0)
    for i, ids in enumerate(PROMPTS):
        pr.submit(f"r{i}", ids)
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    pr.pump(lambda: all(pr.finished("decode", r) and pr.finished("prefill", r) for r in rids))
    for rid, w in zip(rids, want, strict=True):
        got = pr.outs[("decode", rid)]
        assert [t for o in got for t in o.token_ids] == [t for o in w for t in o.token_ids], rid
        lp_got, lp_want = [x for o in got for x in o.logprobs], [x for o in w for x in o.logprobs]
        assert lp_got == pytest.approx(lp_want, abs=1e-4), rid
    row = sum(k.row_bytes for k in pr.d.agent.kinds)  # one token's KV, every layer
    moved = sum(map(len, PROMPTS)) * row
    assert pr.p.agent.take_stats()[0]["sent"]["cuda_ipc"] - sent_before == moved
    assert pr.d.agent.take_stats()[0]["installed"]["cuda_ipc"] == moved
    pr.assert_clean()


def test_a_piece_damaged_in_place_is_a_checksum_error(make_pair):
    pr = make_pair(_engine("prefill"), _engine("decode"))
    _connected(pr)
    _share(pr)
    pr.p.agent.faults = SendFaults(corrupt_p=1.0, delay_s=0.0, seed=0)  # what the flag installs
    pr.submit("c1", PROMPTS[2])
    pr.pump(lambda: pr.finished("decode", "c1") and pr.finished("prefill", "c1"))
    for side in ("decode", "prefill"):  # decode's failure message names the cause to prefill
        o = pr.last(side, "c1")
        assert o.finish_reason == "error" and o.cause == Cause.CHECKSUM, (side, o)
    assert all(not o.token_ids for o in pr.outs[("decode", "c1")])
    pr.assert_clean()


def test_an_in_place_piece_to_a_decode_sharing_nothing_is_an_identity_error(make_pair):
    pr = make_pair(_engine("prefill"), _engine("decode"))
    _connected(pr)
    _share(pr, decode_accepts=False)
    pr.submit("i1", PROMPTS[1])
    pr.pump(lambda: pr.finished("decode", "i1") and pr.finished("prefill", "i1"))
    o = pr.last("decode", "i1")
    assert o.cause == Cause.IDENTITY and "shares no memory" in o.error, o
    assert pr.last("prefill", "i1").cause == Cause.IDENTITY
    pr.assert_clean()
