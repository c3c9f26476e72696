"""Continuous batching with chunked prefill under a per-step token budget.

Every step: running requests first (one token each in decode, the next chunk in prefill), then
new requests while the budget and the KV reservation allow. Admission reserves KV for a request's
prompt and `kv_reserve_ratio` of its max_tokens; when the pool runs dry anyway, the newest running
request is preempted and recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvrelay.cache.page_allocator import PageAllocator, pages_for
from kvrelay.config import SchedulerConfig
from kvrelay.engine.request import Request, Status


@dataclass
class ScheduledRequest:
    req: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is sampled."""
        return self.req.num_computed + self.num_new_tokens == self.req.num_tokens


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        allocator: PageAllocator,
        page_size: int,
        state_slots: PageAllocator | None = None,
    ) -> None:
        self.cfg, self.allocator, self.page_size = cfg, allocator, page_size
        # Per-request state slots (one per running request) for models that keep state
        # outside the pages; sized max_running_requests + 1, so admission never runs out.
        self.state_slots = state_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._arrivals = 0

    def add(self, req: Request) -> None:
        req.arrival = self._arrivals
        self._arrivals += 1
        self.waiting.append(req)

    def find(self, rid: str) -> Request | None:
        for r in self.running:
            if r.rid == rid:
                return r
        for r in self.waiting:
            if r.rid == rid:
                return r
        return None

    def finish(self, req: Request, reason: str) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def _release(self, req: Request) -> None:
        self.allocator.free(req.pages)
        req.pages = []
        if req.state_slot:
            self.state_slots.free([req.state_slot])
            req.state_slot = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    def _future_pages(self, req: Request) -> int:
        """Pages this request may still need: the rest of its prompt and its reserved output."""
        reserve = int(req.remaining_max_tokens * self.cfg.kv_reserve_ratio + 0.999)
        return max(self._pages_for(req.num_tokens + reserve) - len(req.pages), 0)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self._pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        req.pages += self.allocator.alloc(need)
        return True

    def _preempt_newest(self) -> Request:
        victim = max(self.running, key=lambda r: r.arrival)
        self.running.remove(victim)
        self._release(victim)
        victim.reset_for_recompute()
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    def schedule(self) -> tuple[list[ScheduledRequest], list[Request]]:
        """Returns the step's work and the requests that cannot ever fit.

        Those are already out of the queues (finished with reason "error", pages freed); calling
        `finish` on them again is harmless.
        """
        budget = self.cfg.max_num_batched_tokens
        batch: list[ScheduledRequest] = []
        unfittable: list[Request] = []
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.status != Status.RUNNING or budget == 0:
                continue
            n = min(req.num_uncomputed, budget)
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
                batch.append(ScheduledRequest(req, n))
                budget -= n
        budget = self.cfg.max_num_batched_tokens - sum(s.num_new_tokens for s in batch)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            if self._pages_for(req.num_tokens) > self.allocator.num_usable:
                # Even an empty pool cannot hold its tokens: it can never run (and must not be
                # admitted chunk by chunk only to preempt itself forever).
                self.finish(req, "error")
                unfittable.append(req)
                continue
            reserved = sum(self._future_pages(r) for r in self.running)
            need = self._future_pages(req)
            if self.allocator.num_free - reserved < need and self.running:
                break
            n = min(req.num_uncomputed, budget)
            if not self._grow(req, req.num_computed + n):
                if not self.running:
                    # Even an empty pool cannot hold this chunk: the request can never run.
                    self.finish(req, "error")
                    unfittable.append(req)
                    continue
                break
            self.waiting.popleft()
            if self.state_slots is not None:
                req.state_slot = self.state_slots.alloc(1)[0]
            req.status = Status.RUNNING
            self.running.append(req)
            batch.append(ScheduledRequest(req, n))
            budget -= n
        return batch, unfittable

    def advance(self, batch: list[ScheduledRequest]) -> None:
        for s in batch:
            s.req.num_computed += s.num_new_tokens
