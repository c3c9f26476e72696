"""One DeepSeek-V4 forward step as plain lists, and how rank 0 hands it to the other
tensor-parallel ranks.

The scheduler lives on rank 0 only. Each step it broadcasts what the forward needs (token ids,
each request's cached length, new tokens, pages and state slot, the rows whose hidden states are
wanted) as two int64 tensors, a header and a payload; the other ranks run the same forward, so
every collective inside it pairs up. A header of kind STOP ends the followers' loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.engine import tp_install
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.engine.tp_install import InstallPiece
from kvrelay.layers.parallel import TPGroup

STEP, STOP = 1, 0
HEADER = 6  # kind, requests, ids, pages, wanted rows, sampled rows


@dataclass(frozen=True)
class Dsv4Step:
    ids: list[int]  # every request's new tokens back to back
    starts: list[int]  # tokens each request already has in the cache
    counts: list[int]  # its new tokens this step
    pages: list[list[int]]  # its page table
    slots: list[int]  # its compressor-state slot
    rows: list[int]  # rows whose final hidden states are wanted: sampled rows first
    n_sampled: int  # how many of `rows` are sampled (the rest: prompt-logprob rows)


def plan_step(batch: list[ScheduledRequest], all_rows: bool, extra: list[int]) -> Dsv4Step:
    """The step of `batch`: each sampling request's last row is wanted (every row if
    `all_rows`), then the `extra` rows (prompt logprobs)."""
    ids: list[int] = []
    sampled: list[int] = []
    for s in batch:
        first, start = len(ids), s.req.num_computed
        ids += s.req.token_slice(start, start + s.num_new_tokens)
        if all_rows:
            sampled += range(first, len(ids))
        elif s.samples:
            sampled.append(len(ids) - 1)
    return Dsv4Step(
        ids,
        [s.req.num_computed for s in batch],
        [s.num_new_tokens for s in batch],
        [list(s.req.pages) for s in batch],
        [s.req.state_slot for s in batch],
        sampled + list(extra),
        len(sampled),
    )


def send_step(step: Dsv4Step, tp: TPGroup, device: torch.device) -> None:
    b, n_pages = len(step.starts), sum(len(p) for p in step.pages)
    head = [STEP, b, len(step.ids), n_pages, len(step.rows), step.n_sampled]
    tp.broadcast(torch.tensor(head, dtype=torch.int64, device=device))
    payload = (
        step.ids
        + step.starts
        + step.counts
        + step.slots
        + [len(p) for p in step.pages]
        + [i for p in step.pages for i in p]
        + step.rows
    )
    tp.broadcast(torch.tensor(payload, dtype=torch.int64, device=device))


def send_stop(tp: TPGroup, device: torch.device) -> None:
    tp.broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64, device=device))


def recv_step(tp: TPGroup, device: torch.device) -> Dsv4Step | InstallPiece | None:
    """The step rank 0 sent (or a KV piece to install), or None when it said stop."""
    head = tp.broadcast(torch.empty(HEADER, dtype=torch.int64, device=device)).tolist()
    kind, b, n_ids, n_pages, n_rows, n_sampled = head
    if kind == STOP:
        return None
    if kind == tp_install.INSTALL:  # a PD decode server: KV rank 0 received, for every rank
        return tp_install.recv(tp, device, head)
    size = n_ids + 4 * b + n_pages + n_rows
    flat = tp.broadcast(torch.empty(size, dtype=torch.int64, device=device)).tolist()
    parts, at = [], 0
    for n in (n_ids, b, b, b, b, n_pages, n_rows):
        parts.append(flat[at : at + n])
        at += n
    ids, starts, counts, slots, lens, table, rows = parts
    pages, at = [], 0
    for n in lens:
        pages.append(table[at : at + n])
        at += n
    return Dsv4Step(ids, starts, counts, pages, slots, rows, n_sampled)
