"""Property tests of the scheduler's block pool + radix prefix cache under random sequences of
requests (sharing prefixes), n samples of one prompt (a group: the others wait for the first's
prefill), engine steps, aborts (held samples too), preemptions (a small pool), evictions, PD
reservations and fenced transfers; with or without a host tier (evictions offload, hits load
back, the host tier evicts too). No model: a simulated KV records which token each page slot
holds (and a simulated gate moves those records to host slots and back, in order, when a step
passes it), so a request that attends to a shared page is checked to see the right tokens there.
With a sliding window (`lookback` > 0) it also records each position's window row: a PD transfer
writes them only from paging.resume_rows_from on (the pages ending before the prompt's last full
page boundary are cached as not resumable), and every step checks that a request reads present,
right rows for the `lookback` tokens before it (a match never resumes where they lack).

After every operation: refcounts agree with the owners (requests, fences, the tree); host slots
are held by the tree's host nodes alone, each once; a page a request may still write is its own
alone; and when everything has ended and the cache is flushed, every page and host slot is
free."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.cache.block_pool import OutOfPages
from kvrelay.cache.host_tier import HostTier
from kvrelay.cache.paging import resume_rows_from
from kvrelay.config import SchedulerConfig
from kvrelay.engine.messages import SamplingParams
from kvrelay.engine.request import Request, Status
from kvrelay.engine.scheduler import Scheduler

PS = 4
PREFIXES = [[1] * 9, [1] * 8 + [2] * 5, [3] * 13, [1] * 4 + [4] * 6]

# Operation kinds and their weights; each operation draws its own arguments.
OPS = {
    "add": 6,
    "group": 2,
    "step": 8,
    "abort": 1,
    "reserve": 3,
    "arrive": 3,
    "lift": 1,
    "evict": 1,
    "evict_host": 1,
}


class SimulatedGate:
    """The host tier's gate over the simulated KV: copies queue up and land, in order, when a
    step passes the gate (`wait`)."""

    def __init__(self, *dicts: dict[tuple[int, int], int | None]) -> None:
        self.dev, self.host, self.queue = dicts, [{} for _ in dicts], []

    def copy_out(self, pairs) -> None:
        for d, h in zip(self.dev, self.host, strict=True):
            self.queue += [(d, h, page, slot) for page, slot in pairs]

    def copy_in(self, pairs) -> None:
        for d, h in zip(self.dev, self.host, strict=True):
            self.queue += [(h, d, slot, page) for slot, page in pairs]

    def wait(self) -> None:
        for src, dst, a, b in self.queue:
            for off in range(PS):
                dst[(b, off)] = src.get((a, off))
        self.queue = []


class World:
    def __init__(
        self, num_pages: int, budget: int, ratio: float, host_pages: int = 0, lookback: int = 0
    ) -> None:
        cfg = SchedulerConfig(
            max_num_batched_tokens=budget, max_running_requests=6, kv_reserve_ratio=ratio
        )
        self.kv: dict[tuple[int, int], int] = {}  # (page, offset) -> token whose K/V is there
        self.rows: dict[tuple[int, int], int | None] = {}  # the same, of its window row
        self.tier = HostTier(host_pages, SimulatedGate(self.kv, self.rows)) if host_pages else None
        self.lookback = lookback  # tokens before a position whose window rows it reads
        self.s = Scheduler(cfg, num_pages, PS, prefix_cache=True, host_tier=self.tier)
        self.n = 0

    def request(self, prefix: int, tail: int, max_tokens: int) -> Request:
        self.n += 1
        prompt = PREFIXES[prefix] + [100 + self.n] * tail
        return Request(f"r{self.n}", prompt, SamplingParams(max_tokens=max_tokens), 0)

    def write(self, req: Request, start: int, end: int, rows_from: int = 0) -> None:
        """KV of tokens [start, end) into req's pages; window rows from `rows_from` on only
        (those before it are absent: a PD transfer does not send them)."""
        toks = req.token_slice(start, end)
        for p, tok in zip(range(start, end), toks, strict=True):
            self.kv[(req.pages[p // PS], p % PS)] = tok
            self.rows[(req.pages[p // PS], p % PS)] = tok if p >= rows_from else None

    def arrive(self, req: Request) -> None:
        """A reserved transfer's KV lands (after its cached prefix), window rows from where a
        decode that caches receives them, and the request is admitted resumable from the
        boundary they serve on (as the receiver marks it)."""
        n = len(req.prompt_ids)
        rows_from = resume_rows_from(n, PS, self.lookback) if self.lookback else 0
        req.resume_from = rows_from + self.lookback if rows_from else 0
        self.write(req, req.matched_tokens, n, rows_from)
        req.num_computed = n
        req.output_ids.append(300)
        self.s.admit_transferred(req)

    def step(self) -> None:
        s = self.s
        batch, _ = s.schedule()
        if self.tier is not None:  # the engine's gate, before the forward
            self.tier.gate.wait()
        for x in batch:
            r = x.req
            assert x.num_new_tokens >= 1, f"{r.rid} scheduled with nothing to compute"
            # What it attends to: the K/V of its own tokens, wherever the pages came from.
            seen = [self.kv.get((r.pages[p // PS], p % PS)) for p in range(r.num_computed)]
            assert seen == r.token_slice(0, r.num_computed), f"{r.rid} reads the wrong KV"
            lo = max(r.num_computed - self.lookback, 0)  # its window reads these rows back
            rows = [self.rows.get((r.pages[p // PS], p % PS)) for p in range(lo, r.num_computed)]
            assert rows == r.token_slice(lo, r.num_computed), (
                f"{r.rid} resumes at {r.num_computed} without its window rows"
            )
            self.write(r, r.num_computed, r.num_computed + x.num_new_tokens)
        sampling = [x.req for x in batch if x.samples]
        s.advance(batch)
        for r in sampling:
            r.output_ids.append(200 + len(r.output_ids))
            if len(r.output_ids) >= r.params.max_tokens:
                s.finish(r, "length")

    def check(self) -> None:
        s = self.s
        s.check_integrity()
        tree = set(s.prefix.pages())
        for r in s.running + list(s.waiting) + s.reserved:
            # pages it may still write into (a reserved transfer: those after its cached prefix)
            first_written = max(r.num_computed, r.matched_tokens) // PS
            for page in r.pages[first_written:]:
                assert page not in tree and s.page_pool.refcount(page) == 1, (
                    f"{r.rid} would write into shared page {page}"
                )
        for f in s.fences:
            assert not set(f.pages) & tree, "a fenced transfer's page entered the tree"


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_ops=st.integers(1, 120),
    num_pages=st.integers(8, 24),
    budget=st.sampled_from([3, 8, 64]),
    ratio=st.sampled_from([0.0, 1.0]),
    host_pages=st.sampled_from([0, 2, 8, 64]),
    lookback=st.sampled_from([0, 3, 6]),  # no window; within a page (PS = 4); over two
)
def test_pool_and_tree_stay_consistent(
    seed, num_ops, num_pages, budget, ratio, host_pages, lookback
) -> None:
    rng = random.Random(seed)
    w = World(num_pages, budget, ratio, host_pages, lookback)
    s = w.s
    pending: list[Request] = []  # reserved transfers
    for kind in rng.choices(list(OPS), weights=list(OPS.values()), k=num_ops):
        if kind == "add":
            s.add(w.request(rng.randrange(4), rng.randrange(7), rng.randint(1, 6)))
        elif kind == "group":  # n samples of one prompt
            first = w.request(rng.randrange(4), rng.randrange(7), rng.randint(1, 6))
            for i in range(rng.randint(2, 4)):
                r = Request(f"{first.rid}-{i}", first.prompt_ids, first.params, 0)
                r.group = first.rid
                s.add(r)
        elif kind == "step":
            for _ in range(rng.randint(1, 4)):
                w.step()
        elif kind == "abort":
            live = s.running + list(s.waiting) + [r for g in s.siblings.held.values() for r in g]
            if live:
                s.finish(rng.choice(live), "abort")
        elif kind == "reserve" and w.tier is None:  # decode (receives KV) has no host tier
            r = w.request(rng.randrange(4), rng.randrange(7), 3)
            try:
                s.reserve_transfer(r)
                pending.append(r)
            except OutOfPages:
                pass
        elif kind == "arrive" and pending:
            r = pending.pop(rng.randrange(len(pending)))
            if rng.random() < 0.5:  # its KV arrived: admitted with the first token appended
                w.arrive(r)
            else:  # the transfer failed while the peer may still write: fenced
                s.finish_fenced(r, "error")
        elif kind == "lift" and s.fences:
            s.lift(rng.choice(s.fences))
        elif kind == "evict":
            s.prefix.evict(rng.randint(1, 4))
        elif kind == "evict_host" and w.tier is not None:
            s.prefix.evict_host(rng.randint(1, 4))
        w.check()
    # Drain: every request ends, every fence lifts, the cache lets go: all pages free.
    for r in pending:
        s.finish(r, "error")
    for _ in range(400):
        if not s.has_work:
            break
        w.step()
        w.check()
    assert not s.has_work and not s.siblings.leaders
    for f in list(s.fences):
        s.lift(f)
    w.check()
    assert s.page_pool.num_used == s.prefix.num_pages == s.prefix.num_evictable
    if w.tier is not None:
        assert w.tier.slots.num_used == s.prefix.num_host_pages
    s.prefix.flush()
    w.check()
    assert s.page_pool.num_free == s.page_pool.num_usable and s.prefix.num_pages == 0
    assert s.prefix.num_host_pages == 0
    if w.tier is not None:
        assert w.tier.slots.num_free == w.tier.slots.num_usable


def test_a_host_tier_refuses_transferred_kv() -> None:
    """A transfer writes its pages outside the step, past the copy gate, so an offload of a page
    it reuses could still be reading it: the two are never combined."""
    w = World(8, 64, 1.0, host_pages=3)
    with pytest.raises(RuntimeError, match="host tier cannot receive transferred KV"):
        w.s.reserve_transfer(w.request(0, 2, 3))
    assert w.s.page_pool.num_used == 0 and not w.s.reserved


def test_host_tier_round_trips_happen() -> None:
    """The property test's host-tier worlds do offload, load back (and hit) and evict."""
    w = World(8, 64, 1.0, host_pages=3)
    s = w.s
    for _ in range(6):  # 17 tokens each, 4 full pages: 7 usable pages hold about one
        for prefix in (0, 2, 1):
            s.add(w.request(prefix, 4, 1))
            while s.has_work:
                w.step()
                w.check()
    assert w.tier.offloaded and w.tier.loaded and w.tier.evicted and s.prefix.hit_tokens


def test_a_resent_prompt_hits_and_leaves_one_token_to_compute() -> None:
    w = World(64, 64, 1.0)
    s = w.s
    a = w.request(0, 3, 2)  # 12 prompt tokens: 3 full pages
    s.add(a)
    while s.has_work:
        w.step()
    assert s.prefix.num_pages == 3  # 12 prompt + 1 computed output token: 3 full pages
    b = Request("b", list(a.prompt_ids), SamplingParams(max_tokens=2), 0)
    s.add(b)
    batch, _ = s.schedule()
    # 12 tokens match 3 pages, but the last token must be computed: 2 pages shared.
    assert b.num_cached_tokens == 8 and batch[0].num_new_tokens == 4
    assert s.prefix.hit_tokens == 8 and s.prefix.query_tokens == 24
    w.check()
    assert b.status == Status.RUNNING


@pytest.mark.parametrize("lookback", [3, 6])
def test_a_received_prompt_is_never_resumed_where_it_lacks_window_rows(lookback: int) -> None:
    """A 13-token prompt received (window rows from token 12 - lookback: 9 or 6), then a
    9-token prompt that shares its first 8 tokens and a 13-token one that shares all of them:
    the first may not resume at 8 (the rows of 5..7 or 2..7 are absent), the second resumes at
    12."""
    w = World(64, 64, 1.0, lookback=lookback)
    s = w.s
    r = w.request(1, 0, 3)  # [1] * 8 + [2] * 5
    s.reserve_transfer(r)
    w.arrive(r)
    assert r.resume_from == 12
    while s.has_work:
        w.step()
        w.check()
    short, same = w.request(0, 0, 2), w.request(1, 0, 2)  # [1] * 9; r's prompt again
    s.add(short)
    w.step()
    assert short.num_cached_tokens == 0
    s.add(same)
    w.step()
    assert same.num_cached_tokens == 12
    while s.has_work:
        w.step()
        w.check()
    # short computed pages 0 and 1 here: they replaced the received ones, so now it would hit.
    again = w.request(0, 0, 1)
    s.add(again)
    w.step()
    assert again.num_cached_tokens == 8
