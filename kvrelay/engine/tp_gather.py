"""A dense PD prefill server with tensor parallel: each rank's KV pool holds only its KV heads,
so before rank 0 sends a piece every rank hands it its part of the piece's rows.

The mirror of tp_install: rank 0 (the sender, between two steps) broadcasts the piece's facts on
the step channel (a header of kind GATHER), so every rank meets the gather in the same order as
the steps; each rank selects its part of the rows from its own pools and `gather`s it to rank 0,
which puts each row back together in head order (rank r holds part r: `CacheKind.shard`). The
payload is whole rows, the wire layout of a TP=1 prefill: any decode (TP=1 or TP=N) installs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.cache.spec import CacheKind
from kvrelay.engine.kv_pieces import local_rows
from kvrelay.engine.tp_install import PieceFacts, recv_facts, send_facts
from kvrelay.layers.parallel import TPGroup

GATHER = 3  # a step header kind (STOP = 0, STEP = 1, tp_install.INSTALL = 2)


@dataclass(frozen=True)
class GatherPiece(PieceFacts):
    """A follower's order: hand rank 0 your part of these rows."""


def gather_whole(
    tp: TPGroup, device: torch.device, header_len: int, layout: list[CacheKind], page_size: int,
    p: PieceFacts,
) -> memoryview:  # fmt: skip
    """Rank 0: the piece's whole rows (every rank's KV heads), as host bytes."""
    if tp.is_parallel:
        send_facts(tp, device, header_len, GATHER, p)
    return memoryview(contribute(tp, layout, page_size, p).cpu().numpy())


def contribute(tp: TPGroup, layout: list[CacheKind], page_size: int, p: PieceFacts):
    """Every rank: send this rank's part of the rows to rank 0; there, the whole rows."""
    kinds, rows = p.rows(layout, page_size)
    mine = local_rows(kinds, rows)
    if not mine.numel():  # every rank derives the same empty rows: no collective
        return mine
    parts = tp.gather(mine)
    return None if parts is None else join(kinds, rows, parts)


def join(kinds: list[CacheKind], rows: list[torch.Tensor], parts: list[torch.Tensor]):
    """Whole rows from each rank's `local_rows`: row i of a kind is rank 0's part i, rank 1's..."""
    out, off = [], 0
    for k, r in zip(kinds, rows, strict=True):
        nb = len(r) * k.row_bytes // len(parts)  # one rank's part of this kind's rows
        out.append(torch.stack([q[off : off + nb].view(len(r), -1) for q in parts], 1).view(-1))
        off += nb
    return torch.cat(out)


def recv(tp: TPGroup, device: torch.device, head: list[int]) -> GatherPiece:
    """A follower, after a header of kind GATHER: the piece to contribute to."""
    f = recv_facts(tp, device, head)
    return GatherPiece(f.kinds, f.pages, f.slot, f.start, f.end, f.prompt_len, f.resume_rows)
