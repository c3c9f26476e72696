"""kvrelay.engine.scheduler and its real block pool, no model: budgets, order, KV, preemption."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.cache.block_pool import OutOfPages
from kvrelay.config import SchedulerConfig
from kvrelay.engine.messages import SamplingParams
from kvrelay.engine.request import Request, Status
from kvrelay.engine.scheduler import ScheduledRequest, Scheduler


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sched(
    num_pages: int,
    page_size: int = 4,
    budget: int = 2048,
    ratio: float = 1.0,
    max_running: int = 256,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget, max_running_requests=max_running, kv_reserve_ratio=ratio
    )
    return Scheduler(cfg, num_pages, page_size)


def _req(rid: str, prompt_len: int, max_tokens: int = 16) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 0)


def _held(s: Scheduler) -> list[list[int]]:
    return [r.pages for r in s.running] + [r.pages for r in s.waiting]


def _step(s: Scheduler, token: int = 7) -> tuple[list[ScheduledRequest], list[Request]]:
    """One engine step without a model: schedule, advance, append a fake token, finish at length."""
    batch, unfittable = s.schedule()
    sampling = [x.req for x in batch if x.samples]  # evaluated before advance, as the engine does
    s.advance(batch)
    for r in sampling:
        r.output_ids.append(token)
        if len(r.output_ids) >= r.params.max_tokens:
            s.finish(r, "length")
    return batch, unfittable


def _check_batch(s: Scheduler, batch: list[ScheduledRequest]) -> None:
    assert sum(x.num_new_tokens for x in batch) <= s.cfg.max_num_batched_tokens
    assert len({id(x.req) for x in batch}) == len(batch)
    for x in batch:
        r = x.req
        assert x.num_new_tokens >= 1 and r.status == Status.RUNNING
        assert r.num_computed + x.num_new_tokens <= r.num_tokens
        # Every token written this step has a slot.
        assert len(r.pages) * s.page_size >= r.num_computed + x.num_new_tokens


# -- chunked prefill ---------------------------------------------------------------------------


def test_chunked_prefill_respects_budget_and_chunks_add_up() -> None:
    s = _sched(num_pages=64, page_size=4, budget=16)
    a = _req("a", 50, max_tokens=3)
    s.add(a)
    chunks, sampled_at = [], []
    for step in range(8):
        batch, _ = s.schedule()
        _check_batch(s, batch)
        assert [x.req for x in batch] == [a] or not batch
        if not batch:
            break
        chunks.append(batch[0].num_new_tokens)
        samples = batch[0].samples  # before advance: it compares with num_computed
        if samples:
            sampled_at.append(step)
        s.advance(batch)
        if samples:
            a.output_ids.append(5)
            if len(a.output_ids) >= 3:
                s.finish(a, "length")
    assert chunks == [16, 16, 16, 2, 1, 1]
    assert sum(chunks[:4]) == 50
    assert sampled_at == [3, 4, 5]  # the first token only once the whole prompt is in the cache
    assert a.status == Status.FINISHED and s.page_pool.num_free == s.page_pool.num_usable


def test_several_prompts_share_the_budget() -> None:
    s = _sched(num_pages=200, page_size=4, budget=32)
    lens = [40, 7, 25, 60, 3]
    reqs = [_req(f"r{i}", n, max_tokens=4) for i, n in enumerate(lens)]
    for r in reqs:
        s.add(r)
    prefilled = {r.rid: 0 for r in reqs}
    for _ in range(40):
        pending = sum(r.num_uncomputed for r in reqs if r.status != Status.FINISHED)
        batch = s.schedule()[0]
        if not batch:
            break
        _check_batch(s, batch)
        # The pool is large: the step takes all the work there is, up to the budget.
        assert sum(x.num_new_tokens for x in batch) == min(32, pending)
        for x in batch:
            if x.req.num_computed < len(x.req.prompt_ids):
                prefilled[x.req.rid] += x.num_new_tokens
                # A chunk never runs past the prompt while the prompt is being prefilled.
                assert x.req.num_computed + x.num_new_tokens <= len(x.req.prompt_ids)
        sampling = [x.req for x in batch if x.samples]
        s.advance(batch)
        for r in sampling:
            r.output_ids.append(1)
            if len(r.output_ids) >= 4:
                s.finish(r, "length")
    assert prefilled == {r.rid: n for r, n in zip(reqs, lens, strict=True)}
    assert all(r.status == Status.FINISHED for r in reqs)


def test_first_step_fills_the_budget_with_prefill_chunks() -> None:
    s = _sched(num_pages=200, page_size=4, budget=32)
    for i, n in enumerate([20, 20, 20]):
        s.add(_req(f"r{i}", n))
    batch = s.schedule()[0]
    assert [x.num_new_tokens for x in batch] == [20, 12]


# -- ordering ----------------------------------------------------------------------------------


def test_decode_requests_are_scheduled_before_new_prefills() -> None:
    s = _sched(num_pages=200, page_size=4, budget=16)
    a, b = _req("a", 8), _req("b", 8)
    s.add(a)
    s.add(b)
    _step(s)  # both prefilled (16 tokens), both sampled once
    assert a.num_uncomputed == b.num_uncomputed == 1
    c = _req("c", 100)
    s.add(c)
    batch, _ = s.schedule()
    assert [(x.req.rid, x.num_new_tokens) for x in batch] == [("a", 1), ("b", 1), ("c", 14)]


def test_decodes_that_fill_the_budget_leave_no_room_for_prefill() -> None:
    s = _sched(num_pages=200, page_size=4, budget=3)
    reqs = [_req(f"r{i}", 1) for i in range(3)]
    for r in reqs:
        s.add(r)
    _step(s)
    s.add(_req("new", 5))
    for _ in range(3):
        batch, _ = _step(s)
        assert [x.req.rid for x in batch] == ["r0", "r1", "r2"]
    assert [r.rid for r in s.waiting] == ["new"]


def test_max_running_requests_caps_admission() -> None:
    s = _sched(num_pages=200, page_size=4, budget=100, max_running=2)
    for i in range(4):
        s.add(_req(f"r{i}", 3))
    batch, _ = s.schedule()
    assert [x.req.rid for x in batch] == ["r0", "r1"] and len(s.running) == 2


# -- KV reservation and preemption -------------------------------------------------------------


def test_admission_waits_for_the_kv_reservation_and_proceeds_when_pages_free() -> None:
    # 10 usable pages of 4 tokens. Each request: prompt 8 + max_tokens 16 -> 6 pages reserved.
    s = _sched(num_pages=11, page_size=4, budget=64, ratio=1.0)
    a, b = _req("a", 8, max_tokens=16), _req("b", 8, max_tokens=16)
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()
    # a holds 2 pages and reserves 4 more: 8 free - 4 reserved < 6 needed by b.
    assert [x.req for x in batch] == [a] and list(s.waiting) == [b]
    s.advance(batch)
    a.output_ids.append(1)
    for _ in range(5):
        batch, _ = _step(s)
        assert [x.req for x in batch] == [a]
        assert b.status == Status.WAITING and b.pages == []
    s.finish(a, "stop")
    batch, _ = s.schedule()
    assert [x.req for x in batch] == [b] and b.status == Status.RUNNING
    s.page_pool.check_integrity(_held(s))


def test_lower_reserve_ratio_admits_more() -> None:
    # ratio 0.5: a reserves ceil((8 + 8) / 4) - 2 = 2 pages; b needs 4; 8 - 2 >= 4: admitted.
    s = _sched(num_pages=11, page_size=4, budget=64, ratio=0.5)
    a, b = _req("a", 8, max_tokens=16), _req("b", 8, max_tokens=16)
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()
    assert [x.req for x in batch] == [a, b]


def test_preemption_evicts_the_newest_running_request() -> None:
    # 4 usable pages of 4 tokens, no reservation: three 4-token prompts fit, then decode needs more.
    s = _sched(num_pages=5, page_size=4, budget=64, ratio=0.0)
    a, b, c = _req("a", 4), _req("b", 4), _req("c", 4)
    for r in (a, b, c):
        s.add(r)
    _step(s)
    assert s.running == [a, b, c] and s.page_pool.num_free == 1
    d = _req("d", 2)
    s.add(d)
    c_pages = list(c.pages)
    batch, unfittable = s.schedule()
    # a takes the last free page; b needs one more: c (the newest) is evicted for it.
    assert not unfittable and s.num_preemptions == 1
    assert [x.req for x in batch] == [a, b]
    assert c.status == Status.WAITING and c.num_computed == 0 and c.pages == []
    assert list(s.waiting) == [c, d]  # at the front, ahead of the request that was waiting
    assert c.output_ids == [7]  # its output so far is kept and will be recomputed
    assert c_pages[0] in b.pages and s.page_pool.num_free == 0  # c's page went to b
    s.page_pool.check_integrity(_held(s))
    s.advance(batch)
    # Once a and b finish, c is recomputed from scratch: prompt and output, 5 tokens.
    s.finish(a, "stop")
    s.finish(b, "stop")
    batch, _ = s.schedule()
    assert batch[0].req is c and batch[0].num_new_tokens == 5 and batch[0].samples


def test_preemption_of_the_current_request_itself() -> None:
    # The newest request is the one that cannot grow: it preempts itself, the older one runs.
    s = _sched(num_pages=3, page_size=4, budget=64, ratio=0.0)
    a, b = _req("a", 4), _req("b", 4)
    s.add(a)
    s.add(b)
    _step(s)
    batch, unfittable = s.schedule()
    assert [x.req for x in batch] == [a] and not unfittable
    assert list(s.waiting) == [b] and b.num_computed == 0 and s.num_preemptions == 1
    s.page_pool.check_integrity(_held(s))


# -- unfittable requests -----------------------------------------------------------------------


@pytest.mark.parametrize("budget", [64, 8])  # whole prompt in one chunk / chunked prefill
def test_a_prompt_that_can_never_fit_is_reported(budget: int) -> None:
    s = _sched(num_pages=5, page_size=4, budget=budget)  # 16 usable tokens
    big, ok = _req("big", 40), _req("ok", 6, max_tokens=2)
    s.add(big)
    s.add(ok)
    seen: list[Request] = []
    for _ in range(20):
        batch, unfittable = _step(s)
        seen += unfittable
        for r in unfittable:
            s.finish(r, "error")  # what the engine does with them: must be harmless
        s.page_pool.check_integrity(_held(s))
        if not s.has_work:
            break
    assert seen == [big] and big.status == Status.FINISHED
    assert s.num_preemptions == 0  # no admit-chunk-then-preempt-itself loop
    assert ok.status == Status.FINISHED and ok.finish_reason == "length"
    assert s.page_pool.num_free == s.page_pool.num_usable


def test_a_request_that_outgrows_the_whole_pool_alone_is_reported() -> None:
    s = _sched(num_pages=3, page_size=4, budget=64, ratio=0.0)  # 8 usable tokens
    r = _req("r", 6, max_tokens=100)
    s.add(r)
    seen: list[Request] = []
    for _ in range(10):
        seen += _step(s)[1]
        s.page_pool.check_integrity(_held(s))
        if not s.has_work:
            break
    assert seen == [r] and not s.has_work
    assert r.num_tokens == 9  # it ran until its next token had no page left
    assert s.page_pool.num_free == s.page_pool.num_usable


def test_a_request_that_fits_alone_waits_instead_of_being_reported() -> None:
    s = _sched(num_pages=5, page_size=4, budget=64, ratio=1.0)
    a, b = _req("a", 12, max_tokens=4), _req("b", 12, max_tokens=4)
    s.add(a)
    s.add(b)
    for _ in range(30):
        _, unfittable = _step(s)
        assert not unfittable
        if not s.has_work:
            break
    assert a.finish_reason == b.finish_reason == "length"


# -- page accounting under a randomized workload -----------------------------------------------


def _simulate(seed: int, page_size: int, num_pages: int, budget: int, ratio: float, cap: int):
    rng = random.Random(seed)
    s = _sched(num_pages, page_size, budget, ratio, cap)
    reqs: list[Request] = []
    for step in range(20_000):
        if step < 60 and rng.random() < 0.5:
            r = _req(f"r{len(reqs)}", rng.randint(1, 40), max_tokens=rng.randint(1, 20))
            reqs.append(r)
            s.add(r)
        if rng.random() < 0.05:
            live = list(s.running) + list(s.waiting)
            if live:
                s.finish(rng.choice(live), "abort")
        batch, unfittable = s.schedule()
        _check_batch(s, batch)
        assert len(s.running) <= cap
        for r in unfittable:
            assert r.status == Status.FINISHED and r.pages == []
            # Unfittable means: even the empty pool cannot hold what it must compute.
            assert _cdiv(r.num_tokens, page_size) > s.page_pool.num_usable
        sampling = [x.req for x in batch if x.samples]
        s.advance(batch)
        for r in sampling:
            r.output_ids.append(rng.randint(0, 99))
            if len(r.output_ids) >= r.params.max_tokens or rng.random() < 0.05:
                s.finish(r, "stop")
        s.page_pool.check_integrity(_held(s))
        assert all(r.pages == [] and r.num_computed == 0 for r in s.waiting)
        assert all(r.pages == [] for r in reqs if r.status == Status.FINISHED)
        if step >= 60 and not s.has_work:
            break
    assert not s.has_work, "the scheduler did not drain"
    assert s.page_pool.num_free == s.page_pool.num_usable
    return s, reqs


@settings(max_examples=60, deadline=None, database=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    page_size=st.sampled_from([1, 4, 16]),
    num_pages=st.integers(2, 40),
    budget=st.integers(1, 64),
    ratio=st.sampled_from([0.0, 0.3, 1.0]),
    cap=st.integers(1, 8),
)
def test_page_accounting_holds_after_every_step(seed, page_size, num_pages, budget, ratio, cap):
    _simulate(seed, page_size, num_pages, budget, ratio, cap)


def test_randomized_workload_exercises_preemption() -> None:
    # The same simulation on a pool tight enough that preemption really happens.
    s, reqs = _simulate(3, page_size=4, num_pages=12, budget=24, ratio=0.0, cap=8)
    assert s.num_preemptions > 0
    assert sum(r.finish_reason in ("stop", "length") for r in reqs) > 0


def test_check_integrity_catches_a_leaked_or_double_owned_page() -> None:
    s = _sched(num_pages=20, page_size=4, budget=16)
    for i in range(3):
        s.add(_req(f"r{i}", 10))
    for _ in range(3):
        _step(s)
    s.page_pool.check_integrity(_held(s))
    victim = s.running[0]
    leaked = victim.pages.pop()  # held by nobody, and not free
    with pytest.raises(AssertionError):
        s.page_pool.check_integrity(_held(s))
    victim.pages.append(leaked)
    s.page_pool.check_integrity(_held(s))
    s.running[1].pages.append(victim.pages[0])  # owned twice
    with pytest.raises(AssertionError):
        s.page_pool.check_integrity(_held(s))


# -- bounded reservation -----------------------------------------------------------------------


def test_default_reservation_is_bounded_for_a_request_without_max_tokens() -> None:
    # A request without max_tokens gets the rest of the context (here 100k tokens); admission
    # holds room for its prompt and kv_reserve_max_tokens output tokens only.
    cfg = SchedulerConfig()
    s = Scheduler(cfg, num_pages=1000, page_size=16)
    a, b = _req("a", 40, max_tokens=100_000), _req("b", 40, max_tokens=100_000)
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()
    assert [x.req for x in batch] == [a, b]
    assert s._future_pages(a) == _cdiv(40 + cfg.kv_reserve_max_tokens, 16) - len(a.pages)
    assert cfg.kv_reserve_max_tokens == 256


# -- KV for transfers (PD decode) ----------------------------------------------------------------


def test_reserved_transfer_holds_its_prompt_pages_and_counts_against_admission() -> None:
    s = _sched(num_pages=11, page_size=4, budget=64, ratio=1.0)  # 10 usable pages
    r = _req("r", 4, max_tokens=4)  # running: 1 page now, 1 more later
    s.add(r)
    _step(s)
    t = _req("t", 8, max_tokens=8)  # 2 pages now, 2 more later
    s.reserve_transfer(t)
    assert t.status == Status.RESERVED and len(t.pages) == 2 and s.page_pool.num_free == 7
    assert s.find("t") is None  # not scheduled until its KV arrives
    s.check_integrity()
    # 7 free - 3 promised to r and t < the 5 pages w may need: it waits (without counting t's
    # future it would be admitted, and t could run dry once its KV arrives).
    w = _req("w", 8, max_tokens=12)
    s.add(w)
    batch, _ = _step(s)
    assert [x.req for x in batch] == [r] and list(s.waiting) == [w]
    # A transfer that would take more than is uncommitted is refused, saying so, taking nothing.
    free = s.page_pool.num_free
    with pytest.raises(OutOfPages, match="KV cache full"):
        s.reserve_transfer(_req("v", 8, max_tokens=16))
    assert s.page_pool.num_free == free
    s.check_integrity()


def test_admitted_transfer_decodes_from_its_installed_prompt() -> None:
    s = _sched(num_pages=11, page_size=4, budget=64)
    t = _req("t", 8, max_tokens=4)
    s.reserve_transfer(t)
    pages = list(t.pages)
    t.output_ids.append(9)  # the first token, sampled by prefill
    s.admit_transferred(t)
    batch, _ = s.schedule()
    # Only the first token is computed here: the prompt's KV arrived in the reserved pages.
    assert [(x.req, x.num_new_tokens) for x in batch] == [(t, 1)] and batch[0].samples
    assert t.pages[:2] == pages and t.status == Status.RUNNING
    s.finish(t, "stop")
    assert s.page_pool.num_free == s.page_pool.num_usable
    s.check_integrity()


def test_transfer_with_a_state_slot_runs_at_once_keeping_its_slot() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=64)
    s = Scheduler(cfg, num_pages=41, page_size=4, num_state_slots=3)
    t = _req("t", 8)
    s.reserve_transfer(t)
    slot = t.state_slot
    assert slot and s.slot_pool.num_free == 1
    t.output_ids.append(9)
    s.admit_transferred(t)
    assert s.running == [t] and t.state_slot == slot  # no second slot: the state is installed
    batch, _ = s.schedule()
    assert [x.req for x in batch] == [t] and s.slot_pool.num_free == 1
    # Preempted requests waiting for a slot keep it promised: no transfer may take the last one.
    s.waiting.append(_req("preempted", 4))
    with pytest.raises(OutOfPages, match="state slot"):
        s.reserve_transfer(_req("u", 4))
    s.waiting.clear()
    s.finish(t, "stop")
    assert s.slot_pool.num_free == 2
    s.check_integrity()


def test_failed_reservation_finishes_and_returns_its_pages() -> None:
    s = _sched(num_pages=11, page_size=4)
    t = _req("t", 8)
    s.reserve_transfer(t)
    s.finish(t, "error")
    assert t.status == Status.FINISHED and not s.reserved and s.page_pool.num_free == 10
    s.check_integrity()


def test_fenced_pages_stay_out_of_the_pool_until_lifted() -> None:
    s = _sched(num_pages=5, page_size=4, ratio=0.0)  # 4 usable pages
    t = _req("t", 8)
    s.reserve_transfer(t)
    fenced = list(t.pages)
    fence = s.finish_fenced(t, "error")
    assert t.status == Status.FINISHED and t.pages == [] and fence.pages == fenced
    assert s.page_pool.num_free == 2
    s.check_integrity()  # the fence is an owner
    a = _req("a", 8)
    s.add(a)
    _step(s)
    assert not set(a.pages) & set(fenced)  # the next request gets other pages
    s.lift(fence)
    assert not s.fences and s.page_pool.num_free == 2
    s.check_integrity()
