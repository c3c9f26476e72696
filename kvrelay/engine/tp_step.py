"""Rank 0 hands each step's forward batch to the other tensor-parallel ranks.

The scheduler lives on rank 0 only. Every step it broadcasts the prepared batch (token ids,
positions, KV slots, page table, sequence lengths, sampled rows) as two int64 tensors, a header
and a payload; the other ranks rebuild the same `ForwardBatch` and run the same forward, so every
collective inside it pairs up. A header with kind STOP ends the followers' loop.
"""

from __future__ import annotations

import torch

from kvrelay.engine import tp_gather, tp_install
from kvrelay.engine.batch import ForwardBatch
from kvrelay.engine.tp_gather import GatherPiece
from kvrelay.engine.tp_install import InstallPiece
from kvrelay.layers.attention import AttentionMetadata
from kvrelay.layers.parallel import TPGroup

STEP, STOP = 1, 0
HEADER = 7  # kind, T, B, max_pages, N sampled rows, max_q_len, is_decode


def send_batch(fb: ForwardBatch, tp: TPGroup) -> None:
    a = fb.attn
    b, pages = a.page_table.shape
    t, n = fb.input_ids.shape[0], fb.sample_rows.shape[0]
    dev = fb.input_ids.device
    header = torch.tensor([STEP, t, b, pages, n, a.max_q_len, int(a.is_decode)], dtype=torch.int64)
    tp.broadcast(header.to(dev))
    parts = (
        fb.input_ids,
        fb.positions,
        a.slot_mapping,
        a.page_table.reshape(-1),
        a.seq_lens,
        a.cu_seqlens_q,
        fb.sample_rows,
    )
    tp.broadcast(torch.cat([p.to(torch.int64) for p in parts]))


def send_stop(tp: TPGroup, device: torch.device) -> None:
    tp.broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64, device=device))


def recv_batch(
    tp: TPGroup, device: torch.device
) -> ForwardBatch | InstallPiece | GatherPiece | None:
    """The batch rank 0 sent (or a KV piece to install or to gather), or None when it said stop."""
    header = tp.broadcast(torch.empty(HEADER, dtype=torch.int64, device=device)).tolist()
    kind, t, b, pages, n, max_q_len, is_decode = header
    if kind == STOP:
        return None
    if kind == tp_install.INSTALL:  # a PD decode server: KV rank 0 received, for every rank
        return tp_install.recv(tp, device, header)
    if kind == tp_gather.GATHER:  # a PD prefill server: rank 0 sends a piece of every rank's KV
        return tp_gather.recv(tp, device, header)
    payload = tp.broadcast(
        torch.empty(3 * t + b * pages + 2 * b + 1 + n, dtype=torch.int64, device=device)
    )
    ids, pos, slots, table, seq_lens, cu, rows = payload.split([t, t, t, b * pages, b, b + 1, n])
    i32 = torch.int32
    meta = AttentionMetadata(
        slot_mapping=slots,
        page_table=table.to(i32).view(b, pages),
        seq_lens=seq_lens.to(i32),
        cu_seqlens_q=cu.to(i32),
        max_q_len=max_q_len,
        is_decode=bool(is_decode),
    )
    return ForwardBatch(ids, pos, meta, rows, bool(is_decode))
