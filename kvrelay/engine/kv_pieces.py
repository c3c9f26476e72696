"""One PD transfer piece: which rows of its cache kinds it carries, and their bytes out of
(prefill) or into (decode) the pools. Both sides derive the rows from the same facts (the
request's pages and slot, the token range, the prompt length), so only the bytes travel.

Row maths over the pool's cache kinds, used by the engine's workers (tp_gather, tp_install and
the PD connector's worker side) and by the transfer backends above them (disagg/)."""

from __future__ import annotations

import torch

from kvrelay.cache.paging import row_index
from kvrelay.cache.spec import SLOT, CacheKind


def page_rows(kind: CacheKind, pages: list[int], page_size: int, first: int, last: int):
    """Flat row indices (into `kind.byte_rows`) of a request's rows first..last-1."""
    pages_t = torch.tensor(pages, dtype=torch.long, device=kind.tensor.device)
    return row_index(pages_t, first, last, kind.ratio, page_size, kind.tensor.shape[1])


def piece_rows(
    kinds: list[CacheKind],
    pages: list[int],
    slot: int,
    page_size: int,
    start: int,
    end: int,
    prompt_len: int,
    resume_rows: bool,
) -> list[torch.Tensor]:
    """Per kind, the row indices tokens [start, end) fill (a slot kind: its one slot row);
    `resume_rows`: also the window rows a later hit on decode's cached pages reads."""
    out, cache = [], {}
    for k in kinds:
        key = (k.unit, k.ratio, k.keep_last, k.tensor.shape[1], k.tensor.device)
        if key not in cache:
            if k.unit == SLOT:
                cache[key] = torch.tensor([slot], device=k.tensor.device)
            else:
                first, last = k.row_range(start, end, prompt_len, resume_rows)
                cache[key] = page_rows(k, pages, page_size, first, last)
        out.append(cache[key])
    return out


def expected_bytes(kinds: list[CacheKind], rows: list[torch.Tensor]) -> int:
    return sum(k.row_bytes * len(r) for k, r in zip(kinds, rows, strict=True))


def gather_rows(kinds: list[CacheKind], rows: list[torch.Tensor]) -> torch.Tensor:
    """Each kind's rows, in order, as one byte tensor on the cache's device."""
    if any(k.shard[1] > 1 for k in kinds):  # every rank's part first: engine/tp_gather.py
        raise ValueError("a sharded cache kind holds part of each row: it cannot be sent whole")
    return local_rows(kinds, rows)


def local_rows(kinds: list[CacheKind], rows: list[torch.Tensor]) -> torch.Tensor:
    """Each kind's rows as this rank's tensors hold them (a sharded kind: its part), in order,
    as one byte tensor on the cache's device."""
    parts = [k.byte_rows.index_select(0, r).reshape(-1) for k, r in zip(kinds, rows, strict=True)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def gather(kinds: list[CacheKind], rows: list[torch.Tensor]) -> memoryview:
    """The piece's payload: each kind's rows, in order, as host bytes."""
    return memoryview(gather_rows(kinds, rows).cpu().numpy())


def scatter(kinds: list[CacheKind], rows: list[torch.Tensor], payload) -> None:
    """Install a verified payload (sized by `expected_bytes`; host bytes or a uint8 tensor) into
    the pools; a sharded kind keeps its part of each row."""
    if payload is None:
        return  # an empty piece (every row range empty)
    buf = (
        payload
        if isinstance(payload, torch.Tensor)
        else torch.frombuffer(payload, dtype=torch.uint8)
    )
    off = 0
    for k, r in zip(kinds, rows, strict=True):
        nb = k.row_bytes * len(r)
        src = buf[off : off + nb].view(len(r), k.row_bytes)
        rank, world = k.shard
        if world > 1:
            src = src.view(len(r), world, -1)[:, rank]
        k.byte_rows.index_copy_(0, r, src.to(k.tensor.device))
        off += nb
