"""The one gate between the host tier and every reader of a cache pool: it copies whole pages of
every kind the pool owns between device pages and host slots, and `wait()` is the single
synchronisation point a forward passes before any kernel reads the pool.

Which tensors move is what the pool's cache spec declares per page (`cache/spec.py` `page_tensors`), never
a hand-kept list, so a cache kind added to a spec moves with the others (DeepSeek-V4: window
rows, compressed KV of each ratio, index keys and their fp8 scales, the per-page compressor
state `page_prev_*`; dense: each layer's K and V).

Copies run in issue order on one copy queue: a CUDA copy stream (after the compute stream's
work so far; `wait()` makes the compute stream wait for an event), or on the CPU one worker
thread (`wait()` blocks until it is done). In-order copies are what make reuse safe: a device
page offloaded and then reused, or a host slot loaded and then refilled, is only touched again
by a later copy or by a forward that passed the gate.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvrelay.cache.spec import CachePool, page_tensors

__all__ = ["HostTierGate", "page_tensors"]


class HostTierGate:
    def __init__(self, pool: CachePool, capacity: int, device: torch.device) -> None:
        self.kinds = page_tensors(pool)  # name -> device tensor [num_pages, ...]
        pin = device.type == "cuda"
        # Host slot 0 is never used (ids come from a BlockPool), like page 0.
        self.host = {
            n: torch.empty((capacity + 1, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
            for n, t in self.kinds.items()
        }
        self.device = device
        # A copy that failed left pages the tree believes loaded (or offloaded) half-written:
        # from then on every wait() raises, so no forward reads them and the server reports it.
        self.broken: BaseException | None = None
        self.delay: Callable[[], None] | None = None  # test hook: runs inside each kind's copy
        # Test hook: ("in" | "out", kind) per kind copied, ("open", "") when the gate opens.
        self.trace: list[tuple[str, str]] | None = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._event: torch.cuda.Event | None = None
        else:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvrelay-host-tier")
            self._pending: Future | None = None

    @staticmethod
    def bytes_per_page(pool: CachePool) -> int:
        return pool.spec.bytes_per_page

    def copy_out(self, pairs: list[tuple[int, int]]) -> None:
        """Offload: device page -> host slot, for each (page, slot)."""
        if pairs:
            self._submit("out", pairs)

    def copy_in(self, pairs: list[tuple[int, int]]) -> None:
        """Load: host slot -> device page, for each (slot, page)."""
        if pairs:
            self._submit("in", pairs)

    def _copy(self, way: str, pairs: list[tuple[int, int]]) -> None:
        with torch.inference_mode():
            for name, dev in self.kinds.items():
                if self.delay is not None:
                    self.delay()
                host = self.host[name]
                for a, b in pairs:
                    if way == "out":
                        host[b].copy_(dev[a], non_blocking=True)
                    else:
                        dev[b].copy_(host[a], non_blocking=True)
                if self.trace is not None:
                    self.trace.append((way, name))

    def _submit(self, way: str, pairs: list[tuple[int, int]]) -> None:
        if self.device.type == "cuda":
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # pages written so far
            with torch.cuda.stream(self._stream):
                self._copy(way, pairs)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
        else:
            prev = self._pending
            self._pending = self._worker.submit(self._after, prev, way, list(pairs))

    def _after(self, prev: Future | None, way: str, pairs: list[tuple[int, int]]) -> None:
        if prev is not None:
            prev.result()  # one worker runs them in order already; this passes a failure on
        self._copy(way, pairs)

    @property
    def pending(self) -> bool:
        """Copies were issued that no `wait()` has covered yet."""
        if self.device.type == "cuda":
            return self._event is not None
        return self._pending is not None

    def wait(self) -> None:
        """The gate: every copy issued so far is complete (CPU) or ordered before whatever the
        compute stream runs next (CUDA). A forward calls this before it reads the pool."""
        if self.broken is not None:
            raise RuntimeError(f"a host tier copy failed earlier: {self.broken!r}")
        if self.device.type == "cuda":
            if self._event is not None:
                torch.cuda.current_stream(self.device).wait_event(self._event)
                self._event = None
        elif self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except BaseException as e:
                self.broken = e
                raise
        if self.trace is not None:
            self.trace.append(("open", ""))

    def close(self) -> None:
        if self.device.type != "cuda":
            self._worker.shutdown(wait=True)
