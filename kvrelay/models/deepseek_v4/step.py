"""One DeepSeek-V4 forward step as plain lists, and its wire form for the other tensor-parallel
ranks (each request's cached length, new tokens, pages and state slot, the rows whose hidden
states are wanted)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.models.base import Scheduled


@dataclass(frozen=True)
class Dsv4Step:
    ids: list[int]  # every request's new tokens back to back
    starts: list[int]  # tokens each request already has in the cache
    counts: list[int]  # its new tokens this step
    pages: list[list[int]]  # its page table
    slots: list[int]  # its compressor-state slot
    rows: list[int]  # rows whose final hidden states are wanted: sampled rows first
    n_sampled: int  # how many of `rows` are sampled (the rest: prompt-logprob rows)
    all_rows: bool = False  # every row is sampled (tests; never on the wire: followers eager)

    def wire(self) -> tuple[list[int], torch.Tensor]:
        """Header: requests, ids, pages, wanted rows, sampled rows; payload: the lists."""
        b, n_pages = len(self.starts), sum(len(p) for p in self.pages)
        header = [b, len(self.ids), n_pages, len(self.rows), self.n_sampled]
        payload = (
            self.ids
            + self.starts
            + self.counts
            + self.slots
            + [len(p) for p in self.pages]
            + [i for p in self.pages for i in p]
            + self.rows
        )
        return header, torch.tensor(payload, dtype=torch.int64)


def from_wire(header: list[int], payload: torch.Tensor) -> Dsv4Step:
    """The step `Dsv4Step.wire` described, on a follower."""
    b, n_ids, n_pages, n_rows, n_sampled = header[:5]
    flat = payload.tolist()
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


def plan_step(batch: list[Scheduled], all_rows: bool, extra: list[int]) -> Dsv4Step:
    """The step of `batch`: each sampling request's last row is wanted (with drafts: its last
    known token's row and each draft's; every row if `all_rows`), then the `extra` rows
    (prompt logprobs)."""
    ids: list[int] = []
    sampled: list[int] = []
    for s in batch:
        first, start = len(ids), s.req.num_computed
        draft = getattr(s, "draft", ())  # speculative decoding: drafted tokens after the known
        ids += s.req.token_slice(start, start + s.num_new_tokens - len(draft))
        ids += draft
        if all_rows:
            sampled += range(first, len(ids))
        elif s.samples:
            sampled += range(len(ids) - 1 - len(draft), len(ids))
    return Dsv4Step(
        ids,
        [s.req.num_computed for s in batch],
        [s.num_new_tokens for s in batch],
        [list(s.req.pages) for s in batch],
        [s.req.state_slot for s in batch],
        sampled + list(extra),
        len(sampled),
        all_rows,
    )
