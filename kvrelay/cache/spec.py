"""A model's caches declared once: every tensor by name, whether it holds rows per page or per
request (state slot), its shape and dtype, and which of its rows a request reads again.

A model family writes its `CacheSpec`; the pool allocates its tensors from it (`allocate`), the
engine sizes the pool with it (`bytes_per_page`, `bytes_per_slot`), the host tier's gate copies
its page kinds, and a PD transfer describes and moves its kinds (`CacheKind`: a kind bound to
the pool's tensor). Nothing walks a pool's attributes to find its tensors.

- unit "page": first dim = page, second = rows within a page. Row j of a request covers tokens
  [j * ratio, (j + 1) * ratio) and is final once all of them are computed (a compressed entry
  exists only when its window is complete; a value kept per page, such as DeepSeek-V4's
  compressor state at each page end, is one row of `page_size` tokens). `keep_last` > 0: a
  request continuing at token t reads only the rows of tokens [t - keep_last, t) (a sliding
  window; a per-page value read only when resuming at its page's end).
- unit "slot": first dim = the request's state slot (per-request state, e.g. a compressor's
  open window). Only its value after the whole prompt matters to a transfer.
- `shard` (rank, world): the tensor holds only part `rank` of `world` equal parts of each row's
  first dim (a dense model's KV heads under tensor parallel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvrelay.cache.paging import resume_rows_from

PAGE, SLOT = "page", "slot"


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor. On CPU through calloc (numpy's zeros): a large block comes as
    fresh anonymous pages the OS zeroes on first touch, so a pool of several GB costs nothing
    until used (torch.zeros writes every byte up front: ~20 s at start for the default CPU pool
    on 2 cores)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


@dataclass(frozen=True)
class KindSpec:
    """One cache tensor, declared."""

    name: str
    unit: str  # PAGE | SLOT
    layer: int  # kinds of the same layers travel in one piece
    shape: tuple[int, ...]  # one page's part (rows per page, *row) or one slot's (*row)
    dtype: torch.dtype
    ratio: int = 1  # page kinds: tokens per row
    keep_last: int = 0  # page kinds: only the last `keep_last` tokens' rows are read again
    shard: tuple[int, int] = (0, 1)  # (rank, world): this rank's part of each row's first dim

    @property
    def unit_bytes(self) -> int:
        """Bytes of one page (or one slot) of this kind."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class CacheSpec:
    page_size: int  # raw tokens per page
    kinds: tuple[KindSpec, ...]  # in the order a transfer lists them

    def of(self, unit: str) -> tuple[KindSpec, ...]:
        return tuple(k for k in self.kinds if k.unit == unit)

    @property
    def bytes_per_page(self) -> int:
        return sum(k.unit_bytes for k in self.of(PAGE))

    @property
    def bytes_per_slot(self) -> int:
        return sum(k.unit_bytes for k in self.of(SLOT))

    def allocate(
        self, num_pages: int, num_slots: int, device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Zeroed tensors of every kind, by name: [num_pages | num_slots, *shape]."""
        first = {PAGE: num_pages, SLOT: num_slots}
        return {k.name: zeroed((first[k.unit], *k.shape), k.dtype, device) for k in self.kinds}


class CachePool(Protocol):
    """What every pool exposes: its spec and the tensors allocated from it."""

    spec: CacheSpec
    tensors: dict[str, torch.Tensor]
    num_pages: int


@dataclass(frozen=True)
class CacheKind:
    """A cache kind bound to the pool's tensor: what a PD transfer reads and writes."""

    name: str
    tensor: torch.Tensor
    unit: str  # PAGE | SLOT
    layer: int  # kinds of the same layers travel in one piece
    ratio: int = 1  # page kinds: tokens per row
    keep_last: int = 0  # page kinds: only the last `keep_last` tokens' rows are read again
    shard: tuple[int, int] = (0, 1)  # (rank, world): this tensor's part of each row's first dim

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of a whole row (what travels), shards put together."""
        shape = list(self.tensor.shape[2:] if self.unit == PAGE else self.tensor.shape[1:])
        if self.shard[1] > 1:
            shape[0] *= self.shard[1]
        return tuple(shape)

    @property
    def row_bytes(self) -> int:
        n = self.tensor.element_size()
        for d in self.row_shape:
            n *= d
        return n

    @property
    def byte_rows(self) -> torch.Tensor:
        """The tensor as bytes, one row per cache row: [rows, row_bytes / shard world], a view
        (writes land in the pool), the same for every dtype (fp8 included)."""
        t = self.tensor.flatten(0, 1) if self.unit == PAGE else self.tensor
        return t.reshape(t.shape[0], -1).view(torch.uint8)

    def row_range(
        self, start: int, end: int, prompt_len: int, resume_rows: bool = False
    ) -> tuple[int, int]:
        """Rows of a page kind that tokens [start, end) of a `prompt_len`-token prompt complete
        and decode will read (`resume_rows`: or a later hit on its cached pages will read)."""
        r = self.ratio
        first = start // r
        if self.keep_last:
            if resume_rows:
                page_size = self.tensor.shape[1] * r
                oldest = resume_rows_from(prompt_len, page_size, self.keep_last)
            else:
                oldest = max(prompt_len - self.keep_last, 0)
            first = max(first, oldest // r)
        last = end // r
        return first, max(first, last)

    def describe(self) -> str:
        """Everything both sides must agree on for this kind, in one line."""
        shape = "x".join(map(str, self.row_shape))
        per_unit = f"{self.tensor.shape[1]}/page" if self.unit == PAGE else "slot"
        return (
            f"{self.name} {self.unit} {per_unit} row={shape} {self.tensor.dtype} "
            f"ratio={self.ratio} keep_last={self.keep_last}"
        )


def cache_kinds(pool: CachePool) -> list[CacheKind]:
    """Every kind of the pool's spec, bound to the pool's tensor, in the spec's order."""
    t = pool.tensors
    return [
        CacheKind(k.name, t[k.name], k.unit, k.layer, k.ratio, k.keep_last, k.shard)
        for k in pool.spec.kinds
    ]


def page_tensors(pool: CachePool) -> dict[str, torch.Tensor]:
    """The pool's per-page tensors ([num_pages, ...]) by name: what a page is made of."""
    return {k.name: pool.tensors[k.name] for k in pool.spec.of(PAGE)}
