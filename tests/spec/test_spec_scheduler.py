"""Drafts in the scheduler, with its real block pool and radix cache and no model: drafts count
against the step budget but never take the token of a decoding request after them, stay within
the pages a request holds or was promised, count as computed only once verified (a rejected
draft's row never reaches the prefix cache), and leave the accounting whole."""

from __future__ import annotations

from kvrelay.config import SchedulerConfig
from kvrelay.engine.messages import SamplingParams
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import Scheduler

PS = 4
DRAFT = [5, 6, 7, 8]


def _sched(budget: int, num_pages: int = 64, below: int = 0, **cfg) -> Scheduler:
    c = SchedulerConfig(max_num_batched_tokens=budget, max_running_requests=8, **cfg)
    drafter = lambda r, b: DRAFT[:b]  # noqa: E731
    return Scheduler(c, num_pages, PS, prefix_cache=True, drafter=drafter, speculate_below=below)


def _decoding(s: Scheduler, prompts: list[list[int]], max_tokens: int = 20) -> list[Request]:
    """Requests prefilled and holding their first output token."""
    reqs = [
        Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens), 0) for i, p in enumerate(prompts)
    ]
    for r in reqs:
        s.add(r)
    batch, _ = s.schedule()
    assert all(not x.draft for x in batch)  # a prefill drafts nothing
    s.advance(batch)
    for r in reqs:
        r.output_ids.append(1)
    return reqs


def test_drafts_leave_every_decoding_request_its_token():
    s = _sched(budget=6)
    a, b, c = _decoding(s, [[11, 12], [13, 14], [15, 16]])
    batch, _ = s.schedule()
    assert [(x.req.rid, x.num_new_tokens, x.draft) for x in batch] == [
        ("r0", 4, [5, 6, 7]),  # 6 tokens, two of them kept for r1 and r2
        ("r1", 1, []),
        ("r2", 1, []),
    ]
    assert all(x.samples for x in batch)
    s.check_integrity()


def test_no_drafts_from_the_disable_batch_size_up():
    """--speculative-disable-batch-size 3: two decoding requests draft, three do not."""
    s = _sched(budget=64, below=3)
    a, b = _decoding(s, [[11, 12], [13, 14]])
    batch, _ = s.schedule()
    assert [x.draft for x in batch] == [DRAFT, DRAFT]
    s.advance(batch)
    for x in batch:
        x.req.output_ids.append(2)
        s.settle_verified(x.req)
    s.add(Request("r2", [15, 16], SamplingParams(max_tokens=20), 0))
    batch, _ = s.schedule()  # r2's prompt beside them: still two decode
    assert [x.draft for x in batch] == [DRAFT, DRAFT, []]
    s.advance(batch)
    for x in batch:
        x.req.output_ids.append(3)
        if x.draft:
            s.settle_verified(x.req)
    batch, _ = s.schedule()
    assert len(batch) == 3 and all(not x.draft for x in batch)
    s.check_integrity()


def test_verified_drafts_count_once_and_rejected_rows_are_never_cached():
    s = _sched(budget=64)
    prompt = list(range(20, 28))  # two full pages
    (r,) = _decoding(s, [prompt])
    batch, _ = s.schedule()
    assert batch[0].draft == DRAFT and batch[0].num_new_tokens == 5
    assert len(r.pages) == 4  # positions 8..12: the drafts' pages are held
    s.advance(batch)
    assert r.num_computed == 9  # the known token only
    r.output_ids.append(99)  # every draft rejected: the correction token
    s.settle_verified(r)
    assert r.num_computed == 9 == r.num_tokens - 1
    s.check_integrity()
    # The next step drafts again from there; this time all four are accepted, plus the bonus.
    batch, _ = s.schedule()
    assert batch[0].num_new_tokens == 5
    s.advance(batch)
    r.output_ids += [*DRAFT, 42]
    s.settle_verified(r)
    assert r.num_computed == r.num_tokens - 1 == 14
    s.finish(r, "stop")
    # Positions 0..13 computed: three full pages cached (the fourth is not full).
    assert s.prefix.num_pages == 3
    s.check_integrity()
    assert s.page_pool.num_used == 3
    pages, _ = s.prefix.match([*prompt, 1, 99, *DRAFT, 42])
    assert len(pages) == 3


def test_a_rejected_span_leaves_its_page_out_of_the_cache():
    s = _sched(budget=64)
    (r,) = _decoding(s, [list(range(20, 28))])
    batch, _ = s.schedule()  # rows 8..12 written: 8..11 fill the third page
    s.advance(batch)
    r.output_ids.append(99)
    s.settle_verified(r)  # only row 8 is verified: the third page is not full of verified rows
    s.finish(r, "stop")
    assert s.prefix.num_pages == 2
    s.check_integrity()


def test_drafts_stay_within_what_the_request_was_promised():
    # One output token reserved beyond the known ones: the first page only (room for 1 draft).
    s = _sched(budget=64, kv_reserve_max_tokens=1)
    (r,) = _decoding(s, [[11, 12]])
    batch, _ = s.schedule()
    assert batch[0].draft == [5] and len(r.pages) == 1
    s.check_integrity()
