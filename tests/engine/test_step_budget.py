"""`--max-decode-slowdown R` (engine/step_budget.py): while requests decode, a step carries only
the prefill tokens that keep it within R x a decode-only step, predicted from the engine's own
recent steps. The arithmetic on given step times; the scheduler splitting a long prompt beside
decoding requests; and a real engine (dsv4-tiny, float32) with prompts arriving while others
decode: every step within its cap, the same tokens as without the cap."""

from __future__ import annotations

import dataclasses

import pytest
from test_dsv4_engine import make_engine, prompt

from kvrelay.config import SchedulerConfig
from kvrelay.engine.engine import Engine
from kvrelay.engine.messages import AddRequest, SamplingParams
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import Scheduler
from kvrelay.engine.step_budget import PrefillBudget

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend


def _measured(r: float = 1.5) -> PrefillBudget:
    b = PrefillBudget(r, min_tokens=16, max_tokens=2048)
    for rows, ms in ((4, 10.0), (8, 12.0)) * 4:  # decode-only: ms = 8 + 0.5 * rows
        b.observe(rows, 0, ms)
    b.observe(4, 200, 30.0)  # 20 ms beyond the 4 rows' 10: 0.1 ms per prefill token
    return b


def test_the_cap_keeps_the_step_within_r_times_the_decode_step():
    b = _measured(1.5)
    assert b.decode_ms(4) == pytest.approx(10.0) and b.ms_per_token == pytest.approx(0.1)
    assert b.cap(4) == 50  # 0.5 x 10 ms / 0.1 ms per token
    assert b.cap(8) == 60  # 0.5 x 12 ms
    assert b.cap(0) == 2048  # nothing decodes: the whole budget
    assert _measured(1.01).cap(4) == 16  # never below min_tokens: prompts always progress
    fresh = PrefillBudget(1.5, 16, 2048)
    assert fresh.cap(4) == 2048  # nothing measured yet: as without the flag
    off = PrefillBudget(0.0, 16, 2048)
    off.observe(4, 0, 10.0)
    assert off.cap(4) == 2048
    with pytest.raises(ValueError, match="above 1"):
        PrefillBudget(0.9, 16, 2048)


def test_the_scheduler_splits_a_prompt_beside_decoding_requests():
    cfg = SchedulerConfig(max_num_batched_tokens=2048, kv_reserve_ratio=0.0)
    sched = Scheduler(cfg, num_pages=512, page_size=16, prefill_budget=_measured(1.5))
    params = SamplingParams(max_tokens=64)
    decoding = [Request(f"d{i}", [1, 2, 3], params, i) for i in range(4)]
    for r in decoding:
        sched.add(r)
    sched.advance(sched.schedule()[0])  # their prompts
    for r in decoding:
        r.output_ids.append(7)  # each sampled a token: now decoding
    sched.add(Request("long", list(range(1000)), params, 9))
    batch, _ = sched.schedule()
    sizes = {s.req.rid: s.num_new_tokens for s in batch}
    assert sizes == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "long": 50}
    sched.advance(batch)
    for r in decoding:
        sched.finish(r, "stop")
    (s,) = sched.schedule()[0]
    assert s.req.rid == "long" and s.num_new_tokens == 950  # alone: the whole budget


def _staggered(engine, prompts, params) -> tuple[dict[str, list[int]], list]:
    """Each prompt added once the previous one has decoded 3 tokens: prefill beside decode."""
    tokens: dict[str, list[int]] = {}
    steps, pending = [], list(enumerate(prompts))
    added = None
    while pending or engine.has_work:
        if pending and (added is None or len(tokens.get(added, [])) >= 3):
            i, ids = pending.pop(0)
            added = f"r{i}"
            engine.add(AddRequest(added, ids, params))
        out = engine.step()
        steps.append(out.stats)
        for o in out.outputs:
            tokens.setdefault(o.rid, []).extend(o.token_ids)
    return tokens, steps


def test_a_real_engine_keeps_every_step_within_its_cap_and_the_same_tokens():
    prompts = [prompt(n, 40 + i) for i, n in enumerate((20, 300, 40, 500, 250))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want, _ = _staggered(make_engine(budget=512), prompts, params)
    plain = make_engine(budget=512)
    cfg = dataclasses.replace(
        plain.cfg, scheduler=dataclasses.replace(plain.cfg.scheduler, max_decode_slowdown=1.3)
    )
    capped = Engine(cfg, plain.src)  # what `--max-decode-slowdown 1.3` builds
    assert capped.scheduler.prefill_budget is capped.prefill_budget is not None
    got, steps = _staggered(capped, prompts, params)
    assert got == want
    ran = [s for s in steps if s.batch_size]
    assert all(s.prefill_cap for s in ran)
    mixed = [s for s in ran if s.num_prefill and s.batch_size > s.num_prefill]
    assert mixed, "no step carried prefill beside decode"
    for s in ran:
        decoding = s.batch_size - s.num_prefill
        assert s.num_tokens - decoding <= max(s.prefill_cap, 1) + s.num_prefill, s
    assert any(s.prefill_cap < 512 for s in ran)  # the cap was measured and bound
