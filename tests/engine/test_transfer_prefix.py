"""PD decode's prefix cache at the scheduler: a reserved transfer shares (and locks) its longest
cached prefix, holds new pages only for the rest, gives the shared pages back at once when it is
fenced or refused, and its finished prompt enters the tree when it is admitted."""

from __future__ import annotations

import pytest

from kvrelay.cache.block_pool import OutOfPages
from kvrelay.config import SchedulerConfig
from kvrelay.engine.messages import SamplingParams
from kvrelay.engine.request import Request, Status
from kvrelay.engine.scheduler import Scheduler

PS = 4


def _sched(num_pages: int) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=64, kv_reserve_ratio=0.0)
    return Scheduler(cfg, num_pages, PS, prefix_cache=True)


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), 0)


def _cached_turn(s: Scheduler, prompt: list[int]) -> list[int]:
    """A transfer of `prompt` arrives, decodes one token and ends: its full pages are cached."""
    t = _req("turn1", prompt)
    s.reserve_transfer(t)
    assert t.matched_tokens == 0
    t.output_ids.append(9)
    s.admit_transferred(t)
    pages = list(t.pages)
    s.finish(t, "stop")
    return pages


def test_a_transfer_shares_its_cached_prefix_locked_and_reserves_only_the_rest() -> None:
    s = _sched(num_pages=17)
    first = _cached_turn(s, list(range(1, 11)))  # 10 tokens: 2 full pages cached
    assert s.prefix.num_pages == 2
    t = _req("turn2", list(range(1, 11)) + [50, 51, 52])  # 13 tokens: shares those 2 pages
    s.reserve_transfer(t)
    assert t.matched_tokens == 8 and t.pages[:2] == first[:2] and len(t.pages) == 4
    assert s.prefix.hit_tokens == 8 and s.prefix.query_tokens == 10 + 13
    s.prefix.evict(100)  # locked while the transfer holds them: nothing can evict them
    assert s.prefix.num_pages == 2 and s.page_pool.refcount(first[0]) == 2
    s.check_integrity()
    t.output_ids.append(9)
    s.admit_transferred(t)  # its prompt's 3 full pages enter the tree at once
    assert s.prefix.num_pages == 3 and t.status == Status.WAITING
    s.finish(t, "stop")
    s.check_integrity()
    s.prefix.flush()
    assert s.page_pool.num_free == s.page_pool.num_usable


def test_a_whole_cached_prompt_still_leaves_its_last_token_to_transfer() -> None:
    s = _sched(num_pages=17)
    _cached_turn(s, list(range(1, 13)))  # 12 tokens: 3 full pages
    t = _req("again", list(range(1, 13)))
    s.reserve_transfer(t)
    assert t.matched_tokens == 8  # the last page holds the last token: prefill sends it
    s.finish(t, "error")
    s.check_integrity()


def test_a_fenced_transfer_gives_back_its_shared_prefix_at_once() -> None:
    s = _sched(num_pages=17)
    first = _cached_turn(s, list(range(1, 11)))
    t = _req("turn2", list(range(1, 11)) + [50, 51, 52])
    s.reserve_transfer(t)
    own = t.pages[2:]
    fence = s.finish_fenced(t, "error")
    assert fence.pages == own and s.page_pool.refcount(first[0]) == 1  # the tree's alone
    assert s.prefix.num_evictable == 2
    s.check_integrity()
    s.lift(fence)
    s.check_integrity()


def test_a_refused_reservation_unlocks_its_match() -> None:
    s = _sched(num_pages=5)  # 4 usable pages
    _cached_turn(s, list(range(1, 11)))
    big = _req("big", list(range(1, 11)) + list(range(60, 80)))  # 30 tokens: 8 pages
    with pytest.raises(OutOfPages):
        s.reserve_transfer(big)
    assert big.pages == [] and big.matched_tokens == 0 and big.prefix_node is None
    assert s.prefix.num_evictable == 2
    s.check_integrity()
