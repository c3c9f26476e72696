"""Turns the scheduler's choice into the tensors one forward pass reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.layers.attention import AttentionMetadata


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [N] row in [T] of each token whose logits are needed
    is_decode: bool

    @property
    def batch_size(self) -> int:
        return self.attn.seq_lens.shape[0]


def prepare(batch: list[ScheduledRequest], page_size: int, device: torch.device) -> ForwardBatch:
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
        ids += r.token_slice(start, end)
        pos += range(start, end)
        pages = r.pages
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
        seq_lens.append(end)
        cu.append(cu[-1] + s.num_new_tokens)
        if s.samples:
            sample_rows.append(cu[-1] - 1)
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
    )
