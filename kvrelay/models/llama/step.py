"""A dense model's step: the scheduler's choice as the tensors one forward pass reads, and its
wire form for the other tensor-parallel ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.layers.attention import AttentionMetadata
from kvrelay.models.base import Scheduled


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [N] row in [T] of each token whose logits are needed
    is_decode: bool
    prompt_rows: torch.Tensor | None = None  # rows scored for prompt logprobs (rank 0 only)

    @property
    def batch_size(self) -> int:
        return self.attn.seq_lens.shape[0]

    def wire(self) -> tuple[list[int], torch.Tensor]:
        """Header: T, B, max_pages, N sampled rows, max_q_len, is_decode; payload: token ids,
        positions, KV slots, page table, sequence lengths, cu_seqlens, sampled rows."""
        a = self.attn
        b, pages = a.page_table.shape
        t, n = self.input_ids.shape[0], self.sample_rows.shape[0]
        header = [t, b, pages, n, a.max_q_len, int(a.is_decode)]
        parts = (
            self.input_ids,
            self.positions,
            a.slot_mapping,
            a.page_table.reshape(-1),
            a.seq_lens,
            a.cu_seqlens_q,
            self.sample_rows,
        )
        return header, torch.cat([p.to(torch.int64) for p in parts])


def from_wire(header: list[int], payload: torch.Tensor) -> ForwardBatch:
    """The batch `ForwardBatch.wire` described, on a follower."""
    t, b, pages, n, max_q_len, is_decode = header
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


def prepare(
    batch: list[Scheduled], page_size: int, device: torch.device, prompt_rows: Sequence[int] = ()
) -> ForwardBatch:
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    cu = [0]
    sample_rows: list[int] = []
    table = np.zeros((len(batch), max(len(s.req.pages) for s in batch)), dtype=np.int32)
    for b, s in enumerate(batch):
        r, start = s.req, s.req.num_computed
        end = start + s.num_new_tokens
        draft = getattr(s, "draft", ())  # speculative decoding: drafted tokens after the known
        ids += r.token_slice(start, end - len(draft))
        ids += draft
        pos += range(start, end)
        pages = r.pages
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
        seq_lens.append(end)
        cu.append(cu[-1] + s.num_new_tokens)
        if s.samples:  # the last known token's row, and each draft's (verified)
            sample_rows += range(cu[-1] - 1 - len(draft), cu[-1])
        table[b, : len(pages)] = pages

    def to_dev(x, dtype):
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    is_decode = cu[-1] == len(batch)
    meta = AttentionMetadata(
        slot_mapping=to_dev(slots, torch.int64),
        page_table=torch.from_numpy(table).to(device, non_blocking=True),
        seq_lens=to_dev(seq_lens, torch.int32),
        cu_seqlens_q=to_dev(cu, torch.int32),
        max_q_len=max(s.num_new_tokens for s in batch),
        is_decode=is_decode,
    )
    return ForwardBatch(
        to_dev(ids, torch.int64),
        to_dev(pos, torch.int64),
        meta,
        to_dev(sample_rows, torch.int64),
        is_decode,
        to_dev(list(prompt_rows), torch.int64) if prompt_rows else None,
    )
