"""Sharing a prompt's KV while it is still in use, in the scheduler with its real block pool and
radix cache, no model: prompt pages enter the cache as soon as a step computed them (chunk by
chunk), the n samples of one prompt wait for the first one's prefill and then hit it, aborts and
preemptions of either side leave the accounting whole, and without the cache nothing is held."""

from __future__ import annotations

from kvrelay.config import SchedulerConfig
from kvrelay.engine.messages import SamplingParams
from kvrelay.engine.request import Request, Status
from kvrelay.engine.scheduler import Scheduler

PS = 4
PROMPT = list(range(1, 23))  # 22 tokens: 5 full pages and 2 tokens


def _sched(num_pages: int = 64, budget: int = 64, prefix: bool = True) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_running_requests=8)
    return Scheduler(cfg, num_pages, PS, prefix_cache=prefix)


def _group(n: int, prompt=PROMPT, max_tokens: int = 3, **params) -> list[Request]:
    p = SamplingParams(max_tokens=max_tokens, **params)
    reqs = [Request("g" if i == 0 else f"g-{i}", prompt, p, 0) for i in range(n)]
    for r in reqs:
        r.group = "g"
    return reqs


def _step(s: Scheduler) -> dict[str, int]:
    """One step without a model; returns what each scheduled request computed."""
    batch, unfittable = s.schedule()
    assert not unfittable
    sampling = [x.req for x in batch if x.samples]
    s.advance(batch)
    for r in sampling:
        r.output_ids.append(7)
        if len(r.output_ids) >= r.params.max_tokens:
            s.finish(r, "length")
    s.check_integrity()
    return {x.req.rid: x.num_new_tokens for x in batch}


def _drain(s: Scheduler) -> None:
    while s.has_work:
        _step(s)
    assert s.page_pool.num_used == s.prefix.num_pages == s.prefix.num_evictable
    s.prefix.evict(s.prefix.num_evictable)
    assert s.page_pool.num_used == 0 and not s.siblings.leaders


def test_prompt_pages_are_cached_chunk_by_chunk_while_the_request_runs() -> None:
    s = _sched(budget=9)
    a = Request("a", PROMPT, SamplingParams(max_tokens=20), 0)
    s.add(a)
    assert _step(s) == {"a": 9}  # 2 full pages computed: cached, still a's
    assert s.prefix.num_pages == 2 and s.prefix.num_evictable == 0
    assert s.prefix.evict(10) == 0  # a uses them: nothing evictable
    b = Request("b", PROMPT + [99], SamplingParams(max_tokens=2), 0)
    s.add(b)
    assert _step(s) == {"a": 9}  # a's next chunk takes the budget; b waits
    assert s.prefix.num_pages == 4
    # a finishes its prompt while b is admitted with the 4 pages a had cached (a decodes on)
    assert _step(s) == {"a": 4, "b": 5}
    assert b.num_cached_tokens == 16 and b.pages[:4] == a.pages[:4]
    assert s.prefix.num_pages == 5 and a.status == Status.RUNNING
    _drain(s)


def test_n_samples_wait_for_the_first_prefill_then_hit_it() -> None:
    s = _sched()
    reqs = _group(4)
    for r in reqs:
        s.add(r)
    assert [r.status for r in reqs[1:]] == [Status.HELD] * 3
    assert _step(s) == {"g": 22}  # the room was there, but only the leader prefills
    assert _step(s) == {"g": 1, "g-1": 2, "g-2": 2, "g-3": 2}  # the last partial page
    assert [r.num_cached_tokens for r in reqs] == [0, 20, 20, 20]
    assert s.prefix.hit_tokens == 60
    _drain(s)


def test_samples_of_a_cached_prompt_start_with_their_leader() -> None:
    s = _sched()
    for r in _group(2):
        s.add(r)
    while s.has_work:
        _step(s)
    reqs = _group(4)
    for r in reqs:
        s.add(r)
    assert _step(s) == {"g": 2, "g-1": 2, "g-2": 2, "g-3": 2}  # no step waiting for nothing
    assert [r.num_cached_tokens for r in reqs] == [20] * 4
    _drain(s)


def test_an_aborted_leader_or_sample_frees_everything() -> None:
    s = _sched()
    reqs = _group(3)
    for r in reqs:
        s.add(r)
    s.finish(reqs[2], "abort")  # held: leaves the hold
    assert reqs[2].status == Status.FINISHED and len(s.siblings) == 1
    s.finish(reqs[0], "abort")  # the leader, still waiting: its sample queues on its own
    assert reqs[1].status == Status.WAITING and not s.siblings.leaders
    s.check_integrity()
    assert _step(s) == {"g-1": 22}
    _drain(s)


def test_a_leader_preempted_mid_prefill_releases_its_samples() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=2, max_running_requests=8, kv_reserve_ratio=0.0)
    s = Scheduler(cfg, 9, PS, prefix_cache=True)  # 8 pages: a's growth preempts the leader
    a = Request("a", [50] * 4, SamplingParams(max_tokens=20), 0)
    s.add(a)
    _step(s)
    reqs = _group(3, prompt=list(range(1, 17)), max_tokens=4)
    for r in reqs:
        s.add(r)
    while len(s.siblings):
        _step(s)
    leader = reqs[0]
    assert s.num_preemptions == 1 and leader.status == Status.WAITING  # preempted, not done
    assert [r.status for r in reqs[1:]] == [Status.WAITING] * 2
    while s.has_work:
        _step(s)
    assert [r.num_cached_tokens for r in reqs[1:]] == [12, 12]  # the leader's redone prompt
    _drain(s)


def test_nothing_is_held_without_the_prefix_cache_or_for_prompt_logprobs() -> None:
    s = _sched(prefix=False)
    for r in _group(3):
        s.add(r)
    assert len(_step(s)) == 3
    s = _sched()
    for r in _group(3, prompt_logprobs=0):
        s.add(r)
    assert len(_step(s)) == 3
