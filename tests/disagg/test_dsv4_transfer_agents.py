"""DeepSeek-V4 over PD, prefill and decode engines in one process (dsv4-tiny, dummy weights).

Prefill chunks of 22 tokens end mid-window for both compress ratios (4 and 16), so every piece
carries only the compressed entries whose window is complete, and the open windows reach decode
in the state slot after the last chunk. PD must equal one engine, and every path (success,
corrupt bytes, no slot on decode, abort) must give back pages and state slots on both sides.
"""

from __future__ import annotations

import pytest
import torch
from engine_pair import dsv4_engine, pairs

from kvrelay.disagg.protocol import Cause
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
LENGTHS = [5, 17, 40, 110, 150]  # 150: a full 16-token window, 9 ratio-16 and 37 ratio-4 entries


def _engine(
    role: str, budget: int = 22, max_running: int = 16, index_k: str = "auto", **disagg
) -> Engine:
    return dsv4_engine(role, budget, max_running, index_k, **disagg)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # two engines pumped by one thread


@pytest.fixture(scope="module")
def single() -> Engine:
    return _engine("single", budget=64)


@pytest.fixture
def make_pair():
    with pairs() as make:
        yield make


def _assert_clean(pr) -> None:
    pr.assert_clean()
    for e in (pr.p, pr.d):
        assert e.scheduler.slot_pool.num_used == 0


def test_pd_equals_single_engine(make_pair, single):
    pr = make_pair(_engine("prefill"), _engine("decode"))
    prompts = [_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    want = generate(single, prompts, PARAMS)
    for i, ids in enumerate(prompts):
        pr.submit(f"r{i}", ids, PARAMS)
    rids = [f"r{i}" for i in range(len(prompts))]
    pr.pump(lambda: all(pr.finished("decode", r) for r in rids), timeout=60)
    for rid, w in zip(rids, want, strict=True):
        got = pr.outs[("decode", rid)]
        assert [t for o in got for t in o.token_ids] == [t for o in w for t in o.token_ids], rid
        lp_got = [x for o in got for x in o.logprobs]
        assert lp_got == pytest.approx([x for o in w for x in o.logprobs], abs=1e-4), rid
        assert got[-1].finish_reason == "length" and got[-1].error is None
    _assert_clean(pr)


def test_every_kind_arrives_whole(make_pair):
    pr = make_pair(_engine("prefill"), _engine("decode"))
    pr.submit("k1", _prompt(150, seed=7))
    seen = {}

    def progress() -> bool:
        t = next(iter(pr.d.agent.transfers.values()), None)
        if t is not None:
            seen.update(t.filled)
        p = pr.p.agent.transfers.get("k1")
        if p is not None:
            seen["pieces"] = p.pieces
        return pr.finished("decode", "k1")

    pr.pump(progress, timeout=60)
    kinds = pr.d.agent.kinds
    assert {k.name for k in kinds} == set(pr.d.runner.cache.kinds)
    # 7 chunks (6 x 22 + 18) x 3 page groups (layers 0-1 | 2-3 | 4), then the state slots of
    # the compressed layers once: 3 groups (1 | 2-3 | 4)
    assert seen["pieces"] == 7 * 3 + 3
    assert pr.last("decode", "k1").finish_reason == "length"
    _assert_clean(pr)


def _assert_failed(pr, rid: str, side: str, cause: str) -> None:
    o = pr.last(side, rid)
    assert o.finish_reason == "error" and o.cause == cause, (side, o)


def test_corrupt_bytes_free_pages_and_slots(make_pair):
    pr = make_pair(_engine("prefill", test_corrupt_p=1.0), _engine("decode"))
    pr.submit("c1", _prompt(110, seed=3))
    pr.pump(lambda: pr.finished("decode", "c1") and pr.finished("prefill", "c1"), timeout=60)
    _assert_failed(pr, "c1", "decode", Cause.CHECKSUM)
    _assert_failed(pr, "c1", "prefill", Cause.CHECKSUM)
    _assert_clean(pr)


def test_no_free_state_slot_refuses_before_prefill_computes(make_pair):
    pr = make_pair(_engine("prefill"), _engine("decode", max_running=1))
    pr.submit("hold", _prompt(40, seed=4), send_prefill=False)  # holds decode's only slot
    assert pr.d.scheduler.slot_pool.num_free == 0
    pr.submit("more", _prompt(40, seed=5))
    pr.pump(lambda: pr.finished("decode", "more") and pr.finished("prefill", "more"), timeout=60)
    _assert_failed(pr, "more", "decode", Cause.NO_KV)
    _assert_failed(pr, "more", "prefill", Cause.REFUSED)
    assert "state slot" in pr.last("prefill", "more").error
    pr.d.abort("hold")  # an abort while reserved gives the slot back
    _assert_clean(pr)


def test_abort_while_receiving_frees_the_slot(make_pair):
    pr = make_pair(_engine("prefill"), _engine("decode"))
    pr.submit("a1", _prompt(150, seed=6))

    def receiving() -> bool:
        t = next(iter(pr.d.agent.transfers.values()), None)
        return t is not None and t.num_chunks > 0

    pr.pump(receiving, timeout=60)
    pr.d.abort("a1")
    pr.pump(lambda: pr.finished("prefill", "a1") and pr.finished("decode", "a1"), timeout=60)
    assert pr.last("decode", "a1").finish_reason == "abort"
    _assert_failed(pr, "a1", "prefill", Cause.PEER_FAILED)
    _assert_clean(pr)


def test_mismatched_layout_refuses_to_pair_naming_the_kind(make_pair):
    pr = make_pair(_engine("prefill"), _engine("decode", index_k="fp8"))
    pr.submit("x1", _prompt(17, seed=8))
    pr.pump(lambda: pr.finished("prefill", "x1"), timeout=60)
    o = pr.last("prefill", "x1")
    assert o.cause == Cause.LAYOUT and "c4_index_k" in o.error, o.error
    pr.d.abort("x1")
    _assert_clean(pr)
