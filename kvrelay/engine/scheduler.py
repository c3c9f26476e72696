"""Continuous batching with chunked prefill under a per-step token budget; owns which KV pages
and state slots are in use.

Every step: running requests first (one token each in decode, the next chunk in prefill), then
new requests while the budget and the KV reservation allow. Admission reserves KV for a request's
prompt and `kv_reserve_ratio` of its max_tokens, at most `kv_reserve_max_tokens` of them (a
request without a real limit must not hold the whole context); running requests grow page by page
and, when the pool runs dry anyway, the newest running request is preempted and recomputed later.

The runner owns the cache tensors; the scheduler owns the refcounted pools of their page and slot
ids. Everything outside the engine (the PD receiver and sender) goes through the public operations
here: reserve KV for an incoming transfer, admit a request whose KV has arrived, finish (or fence)
a request.

With a prefix cache (kvrelay.cache.radix), a request admitted with nothing computed first shares
the pages of its longest cached prefix (full pages, leaving at least one token to compute) and
computes only the rest. A request hands the full pages of its prompt to the cache as soon as a
step computed them (it keeps its reference and locks them: requests admitted meanwhile share them,
e.g. conversations sharing a system prompt), and the rest of its full computed pages when it ends
(or is preempted). Pages held by the cache alone count as available: the cache evicts its least
recently used ones before the scheduler preempts or refuses anything (to host memory, with a
host tier: a later match loads them back; radix.py, host_tier.py). The n samples of one prompt
(a request `group`) wait until the first one's prompt is cached, then share it (siblings.py).

With speculative decoding (a `drafter`, engine/drafter.py), a decoding request also schedules the
tokens it drafts, within the step budget and the pages it holds or was promised; they count as
computed only once verified (`settle_verified`), so a rejected draft's row is never cached.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.cache.block_pool import BlockPool, OutOfPages
from kvrelay.cache.host_tier import HostTier
from kvrelay.cache.paging import pages_for
from kvrelay.cache.radix import RadixCache
from kvrelay.config import SchedulerConfig
from kvrelay.engine.request import Request, Status
from kvrelay.engine.siblings import SiblingHold
from kvrelay.engine.step_budget import PrefillBudget


@dataclass
class ScheduledRequest:
    req: Request
    num_new_tokens: int  # drafts included
    # Speculative decoding: tokens drafted after the known ones (their rows are verified)
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is sampled."""
        return self.req.num_computed + self.num_new_tokens == self.req.num_tokens + len(self.draft)


@dataclass
class Fence:
    """A finished request's pages and slot, kept out of the pools while a peer may still write
    into them (a transfer that failed on this side while prefill was sending)."""

    rid: str
    pages: list[int]
    state_slot: int


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        num_pages: int,
        page_size: int,
        num_state_slots: int = 0,
        prefix_cache: bool = False,
        host_tier: HostTier | None = None,
        prefill_budget: PrefillBudget | None = None,
        drafter: Callable[[Request, int], list[int]] | None = None,
        speculate_below: int = 0,
    ) -> None:
        self.cfg, self.page_size = cfg, page_size
        self.prefill_budget = prefill_budget  # caps prefill tokens beside decoding requests
        # Speculative decoding: (request, budget) -> the tokens it drafts this step (drafter.py)
        self.drafter = drafter
        self.speculate_below = speculate_below  # drafts while fewer decode (0: always)
        self.page_pool = BlockPool(num_pages, "page")
        # Per-request state slots (one per running request) for models that keep state outside
        # the pages; sized max_running_requests + 1, so admission never runs out.
        self.slot_pool = BlockPool(num_state_slots, "state slot") if num_state_slots else None
        # The host tier (host_tier.py) keeps what the prefix cache evicts, for later hits.
        self.prefix = RadixCache(page_size, self.page_pool, host_tier) if prefix_cache else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: list[Request] = []  # KV held for transfers still arriving (PD decode)
        self.fences: list[Fence] = []
        self.siblings = SiblingHold()  # n samples waiting for their leader's prompt
        self.num_preemptions = 0
        self._arrivals = 0

    # -- requests in and out -------------------------------------------------------------------

    def add(self, req: Request) -> None:
        req.arrival = self._arrivals
        self._arrivals += 1
        if self._shares_prompt(req) and self.siblings.hold(req):
            req.status = Status.HELD
            return
        self.waiting.append(req)

    def _shares_prompt(self, req: Request) -> bool:
        """req is an n sample that can take its leader's cached prompt pages: the prefix cache is
        on, req asks it (no prompt logprobs) and its prompt has a full page to share."""
        return (
            self.prefix is not None
            and req.group is not None
            and req.params.prompt_logprobs is None
            and (len(req.prompt_ids) - 1) // self.page_size > 0
        )

    def _wake_if_cached(self, req: Request) -> None:
        """A leader admitted with its whole prompt cached (but the page of its last token) lets
        its samples go at once: they find the same pages (in this very step, budget allowing)."""
        if req.num_computed >= (len(req.prompt_ids) - 1) // self.page_size * self.page_size:
            self._wake_siblings(req)

    def _wake_siblings(self, leader: Request) -> None:
        """The samples held for `leader` queue for admission, in arrival order."""
        for r in self.siblings.release(leader):
            r.status = Status.WAITING
            at = next((i for i, w in enumerate(self.waiting) if w.arrival > r.arrival), None)
            self.waiting.insert(len(self.waiting) if at is None else at, r)

    def find(self, rid: str) -> Request | None:
        """A running or waiting request (a reserved transfer is the PD receiver's to end: it
        knows whether its pages must be fenced)."""
        for r in self.running:
            if r.rid == rid:
                return r
        for r in self.waiting:
            if r.rid == rid:
                return r
        return self.siblings.find(rid)

    def finish(self, req: Request, reason: str) -> None:
        """Out of the queues, pages and slot back to the pools (harmless when already finished).
        The full pages of what it computed go to the prefix cache, unless it failed ("error":
        its KV is not trusted) or its KV was still arriving (a reserved transfer)."""
        cache = reason != "error" and req.status in (Status.RUNNING, Status.WAITING)
        self._leave(req, reason)
        self._release(req, cache)

    def finish_fenced(self, req: Request, reason: str) -> Fence:
        """Finish, but keep the request's pages and slot out of the pools until `lift(fence)`:
        a peer may still be writing into them. Only a reserved transfer is fenced: the cached
        prefix it shares goes back at once (the peer was told to write only after it)."""
        if req.status != Status.RESERVED:
            raise ValueError(f"request {req.rid} is not a reserved transfer: it cannot be fenced")
        self._leave(req, reason)
        shared = req.matched_tokens // self.page_size
        if req.prefix_node is not None:
            self.prefix.unlock(req.prefix_node)
            req.prefix_node = None
        self.page_pool.free(req.pages[:shared])
        fence = Fence(req.rid, req.pages[shared:], req.state_slot)
        req.pages, req.state_slot = [], 0
        self.fences.append(fence)
        return fence

    def lift(self, fence: Fence) -> None:
        """The peer can no longer write into a fenced request's pages: they go back."""
        self.fences.remove(fence)
        self.page_pool.free(fence.pages)
        if fence.state_slot:
            self.slot_pool.free([fence.state_slot])

    def _leave(self, req: Request, reason: str) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        elif req.status == Status.RESERVED:
            self.reserved.remove(req)
        elif req.status == Status.HELD:
            self.siblings.remove(req)
        self._wake_siblings(req)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def _release(self, req: Request, cache: bool = False) -> None:
        if self.prefix is not None:
            if cache:
                tokens = req.token_slice(0, req.num_computed)
                self.prefix.insert(tokens, req.pages, req.resume_from)
            if req.prefix_node is not None:
                self.prefix.unlock(req.prefix_node)
                req.prefix_node = None
        self.page_pool.free(req.pages)
        req.pages = []
        if req.state_slot:
            self.slot_pool.free([req.state_slot])
            req.state_slot = 0

    # -- KV for transfers (PD decode) ----------------------------------------------------------

    def reserve_transfer(self, req: Request) -> None:
        """Hold the pages of req's prompt (and a state slot) for KV that another engine sends.
        With a prefix cache, req first shares its longest cached prefix (`req.matched_tokens`:
        the sender sends only the rest), locked until req ends.

        Raises OutOfPages, saying why, unless the request fits next to what running, waiting and
        reserved requests may still need (back-pressure: a refusal now, not an OOM later)."""
        if self.prefix is not None and self.prefix.host is not None:
            # Transferred KV lands outside the step, past the host tier's copy gate: a page just
            # offloaded could be overwritten before its copy is done (the engine turns the tier
            # off on decode; this keeps any other caller from combining them).
            raise RuntimeError("a scheduler with a host tier cannot receive transferred KV")
        if self.prefix is not None:
            self._share_prefix(req)
        committed = sum(self._future_pages(r) for r in self._holders())
        need_all = self._future_pages(req)
        free = self._available() - committed
        if need_all > free:
            self._unmatch(req)
            raise OutOfPages(
                f"decode KV cache full: the request needs {need_all} pages, "
                f"{max(free, 0)} are uncommitted"
            )
        # Waiting requests (preempted ones) need a slot when admitted again.
        slots = self.slot_pool
        if slots is not None and slots.num_free <= len(self.waiting):
            self._unmatch(req)
            raise OutOfPages(
                f"decode has no free state slot ({slots.num_usable} in use or promised)"
            )
        req.pages += self._alloc(self._pages_for(len(req.prompt_ids)) - len(req.pages))
        if slots is not None:
            req.state_slot = slots.alloc(1)[0]
        if self.prefix is not None:  # metrics: what decode's cache spared the transfer
            self.prefix.query_tokens += len(req.prompt_ids)
            self.prefix.hit_tokens += req.matched_tokens
        req.status = Status.RESERVED
        self.reserved.append(req)

    def admit_transferred(self, req: Request) -> None:
        """req's prompt KV (and state) arrived in its reserved pages and its first token is
        appended: it continues from there. With a state slot it runs at once (admission would
        take a second slot, dropping the installed state); otherwise it queues for admission."""
        self.reserved.remove(req)
        req.num_computed = len(req.prompt_ids)
        self._cache_prompt(req, req.matched_tokens)  # later transfers share it from now on
        self.add(req)  # stamps its arrival order (preemption evicts the newest)
        if req.state_slot:
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
        else:
            req.status = Status.WAITING

    # -- accounting ----------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.siblings.held)

    def _holders(self) -> list[Request]:
        return self.running + list(self.waiting) + self.reserved

    def check_integrity(self) -> None:
        """Every page and slot is free or held by its owners (requests, fences, the prefix
        cache) exactly as often as counted."""
        owners = self._holders()
        held = [r.pages for r in owners] + [f.pages for f in self.fences]
        if self.prefix is not None:
            held.append(self.prefix.pages())
            self.prefix.check_integrity([r.prefix_node for r in owners if r.prefix_node])
        self.page_pool.check_integrity(held)
        if self.slot_pool is not None:
            slots = [[r.state_slot] for r in owners if r.state_slot]
            slots += [[f.state_slot] for f in self.fences if f.state_slot]
            self.slot_pool.check_integrity(slots)
        problems = self.siblings.check(self.running + list(self.waiting))
        if problems:
            raise AssertionError("n samples held wrongly: " + "; ".join(problems[:4]))

    def _pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    def _reserve_tokens(self, req: Request) -> int:
        """Output tokens whose KV admission holds room for; the rest grows on demand."""
        want = int(req.remaining_max_tokens * self.cfg.kv_reserve_ratio + 0.999)
        return min(want, self.cfg.kv_reserve_max_tokens)

    def _future_pages(self, req: Request) -> int:
        """Pages this request may still need: the rest of its prompt and its reserved output."""
        need = self._pages_for(req.num_tokens + self._reserve_tokens(req))
        return max(need - len(req.pages), 0)

    def _available(self) -> int:
        """Pages free now or once the prefix cache evicts what it alone holds."""
        return self.page_pool.num_free + (self.prefix.num_evictable if self.prefix else 0)

    def _alloc(self, n: int) -> list[int]:
        short = n - self.page_pool.num_free
        if short > 0 and self.prefix is not None:
            self.prefix.evict(short)
        return self.page_pool.alloc(n)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self._pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if need > self._available():
            return False
        req.pages += self._alloc(need)
        return True

    def _match(self, req: Request) -> bool:
        """Share the pages of req's longest cached prefix (req computes the rest). At least one
        token stays to compute: its logits are what the next step samples from. False when req
        does not ask the cache (no cache, it holds KV already: a transferred request, or it wants
        prompt logprobs, which are scored in its own prefill)."""
        if self.prefix is None or req.pages or req.num_computed:
            return False
        if req.params.prompt_logprobs is not None:  # every prompt position must be computed
            return False
        req.num_computed = self._share_prefix(req)
        return True

    def _share_prefix(self, req: Request) -> int:
        """req takes (and locks) the pages of its longest cached prefix, leaving at least its
        last known token uncovered; returns how many tokens they hold."""
        pages, node = self.prefix.match(req.token_slice(0, req.num_tokens - 1))
        req.matched_tokens = len(pages) * self.page_size
        if pages:
            req.pages = self.page_pool.share(pages)
            self.prefix.lock(node)
            req.prefix_node = node
        return req.matched_tokens

    def _count_hit(self, req: Request) -> None:
        """An admitted request asked the cache: count it (metrics) and, the first time, tell
        its usage how many prompt tokens the cache provided."""
        self.prefix.query_tokens += req.num_tokens
        self.prefix.hit_tokens += req.num_computed
        if not req.cache_queried:
            req.cache_queried = True
            req.num_cached_tokens = min(req.num_computed, len(req.prompt_ids))

    def _unmatch(self, req: Request) -> None:
        """Undo `_match` (or a refused reservation's `_share_prefix`) for a request that
        holds nothing else."""
        req.matched_tokens = 0
        if req.prefix_node is None:
            return
        self.prefix.unlock(req.prefix_node)
        self.page_pool.free(req.pages)
        req.prefix_node, req.pages, req.num_computed = None, [], 0

    def _preempt_newest(self) -> Request:
        victim = max(self.running, key=lambda r: r.arrival)
        self.running.remove(victim)
        self._wake_siblings(victim)  # they share what it cached (recomputing the rest)
        self._release(victim, cache=True)  # its computed prefix may come back as a cache hit
        victim.reset_for_recompute()
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    # -- the step ------------------------------------------------------------------------------

    def schedule(self) -> tuple[list[ScheduledRequest], list[Request]]:
        """Returns the step's work and the requests that cannot ever fit.

        Those are already out of the queues (finished with reason "error", pages freed); calling
        `finish` on them again is harmless.
        """
        budget = self.cfg.max_num_batched_tokens
        batch: list[ScheduledRequest] = []
        unfittable: list[Request] = []
        prefill_left = self._prefill_cap()
        # Drafts take only what leaves one token for every decoding request after them.
        decoders = sum(1 for r in self.running if r.num_uncomputed == 1)
        below = self.speculate_below
        speculate = self.drafter is not None and (not below or decoders < below)
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.status != Status.RUNNING or budget == 0:
                continue
            decoders -= req.num_uncomputed == 1
            n = min(req.num_uncomputed, budget)
            prefill = n > 1  # a prefill chunk: within what the decoding requests leave it
            if prefill:
                n = min(n, prefill_left)
                if n == 0:
                    continue
            while not self._grow(req, req.num_computed + n):
                victim = self._preempt_newest()
                batch = [s for s in batch if s.req is not victim]
                if victim is req:
                    if not self.running:
                        # Alone it still cannot grow: even the whole pool is too small.
                        self.finish(req, "error")
                        unfittable.append(req)
                    break
            if req.status == Status.RUNNING:
                draft = []
                if req.num_uncomputed == 1 and speculate and budget - 1 > decoders:  # decodes
                    draft = self._draft(req, budget - 1 - decoders)
                batch.append(ScheduledRequest(req, n + len(draft), draft))
                budget -= n + len(draft)
                if prefill:
                    prefill_left -= n
        budget = self.cfg.max_num_batched_tokens - sum(s.num_new_tokens for s in batch)
        budget = min(budget, prefill_left)  # what waits is prefill
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            if self._pages_for(req.num_tokens) > self.page_pool.num_usable:
                # Even an empty pool cannot hold its tokens: it can never run (and must not be
                # admitted chunk by chunk only to preempt itself forever).
                self.finish(req, "error")
                unfittable.append(req)
                continue
            queried = self._match(req)
            # Reserved transfers count too: they join the running set once their KV arrives.
            reserved = sum(self._future_pages(r) for r in self.running + self.reserved)
            need = self._future_pages(req)
            if self._available() - reserved < need and self.running:
                if queried:  # a transferred request's pages are its KV: it keeps them
                    self._unmatch(req)
                break
            n = min(req.num_uncomputed, budget)
            if not self._grow(req, req.num_computed + n):
                if not self.running:
                    # Even an empty pool cannot hold this chunk: the request can never run.
                    self.finish(req, "error")
                    unfittable.append(req)
                    continue
                if queried:
                    self._unmatch(req)
                break
            self.waiting.popleft()
            if queried:
                self._count_hit(req)
                self._wake_if_cached(req)
            if self.slot_pool is not None and not req.state_slot:
                req.state_slot = self.slot_pool.alloc(1)[0]
            req.status = Status.RUNNING
            self.running.append(req)
            batch.append(ScheduledRequest(req, n))
            budget -= n
        return batch, unfittable

    def _draft(self, req: Request, budget: int) -> list[int]:
        """The drafts req verifies this step (it decodes; its next token's page is there), in
        pages it holds or its own reservation still counts on: drafts never take pages that
        another request was promised, and never preempt anyone (no room: fewer drafts)."""
        draft = self.drafter(req, budget)
        if not draft:
            return draft
        ps = self.page_size
        room = (len(req.pages) + self._future_pages(req)) * ps - req.num_tokens
        draft = draft[: max(room, 0)]
        if draft and not self._grow(req, req.num_tokens + len(draft)):
            return []
        return draft

    def settle_verified(self, req: Request) -> None:
        """After a verify step committed req's accepted drafts and its bonus (or correction)
        token: the KV of every committed token but the last is computed (the rejected drafts'
        rows beyond are overwritten when their positions are computed again). Its pages stay
        (later steps fill them); its prefix-cache insert reads num_computed, so a page holding
        a rejected draft's row is never registered."""
        req.num_computed = req.num_tokens - 1

    def _prefill_cap(self) -> int:
        """Prefill tokens this step may carry: the whole budget, or with a PrefillBudget what
        keeps the requests now decoding at their pace."""
        if self.prefill_budget is None:
            return self.cfg.max_num_batched_tokens
        decoding = sum(
            1
            for r in self.running
            if r.status == Status.RUNNING and r.num_uncomputed == 1 and r.output_ids
        )
        return self.prefill_budget.cap(decoding)

    def advance(self, batch: list[ScheduledRequest]) -> None:
        """The step's forward wrote its chunks: count them, cache the prompt pages completed."""
        for s in batch:
            req = s.req
            # Drafts count once verified (settle_verified): only the known tokens here.
            req.num_computed += s.num_new_tokens - len(s.draft)
            self._cache_prompt(req, req.num_computed - s.num_new_tokens)
            if req.num_computed >= len(req.prompt_ids):
                self._wake_siblings(req)

    def _cache_prompt(self, req: Request, before: int) -> None:
        """Hand the full prompt pages that req computed since `before` to the prefix cache while
        it runs, so requests admitted from now on share them. req keeps its reference and moves
        its lock to the end of the cached path: nothing it uses can be evicted. Only pages it will
        never write again (full, below num_computed) go in, so a shared page stays read-only."""
        if self.prefix is None:
            return
        n, ps = len(req.prompt_ids), self.page_size
        if min(req.num_computed, n) // ps <= min(before, n) // ps:
            return  # no prompt page completed
        tokens = req.prompt_ids[: min(req.num_computed, n) // ps * ps]
        self.prefix.insert(tokens, req.pages, req.resume_from)
        node = self.prefix.node_at(tokens)  # the path now ends where tokens do
        self.prefix.lock(node)
        if req.prefix_node is not None:
            self.prefix.unlock(req.prefix_node)
        req.prefix_node = node
