"""The torch token grouping of the fused MoE (kvrelay/kernels/moe_grouping.py) on the CPU: every
assignment placed once, in its expert's blocks, in order; block labels and row counts right;
the buffers sized for the worst case whatever the routing."""

from __future__ import annotations

import zlib

import pytest
import torch

from kvrelay.kernels.moe_grouping import group_by_expert, max_blocks


def _routing(t: int, e: int, k: int, mode: str, gen: torch.Generator) -> torch.Tensor:
    if mode == "topk":
        return torch.rand(t, e, generator=gen).topk(k, dim=-1).indices
    if mode == "one":  # every token to the same k experts
        return torch.randperm(e, generator=gen)[:k].expand(t, k).clone()
    return torch.randint(0, e, (t, k), generator=gen)  # hash-like, repeats allowed


@pytest.mark.parametrize("mode", ["topk", "one", "hash"])
@pytest.mark.parametrize(
    "t,e,k,bm", [(1, 8, 2, 16), (7, 8, 2, 16), (64, 8, 2, 32), (300, 256, 6, 16), (40, 5, 3, 64)]
)
def test_layout(t, e, k, bm, mode) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(repr((t, e, k, bm, mode)).encode()))
    idx = _routing(t, e, k, mode, gen)
    g = group_by_expert(idx, e, bm)
    nb = max_blocks(t * k, e, bm)
    assert g.token_ids.shape == (nb * bm,) and g.block_expert.shape == g.block_rows.shape == (nb,)
    flat = idx.reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    want_blocks = [ex for ex in range(e) for _ in range(-(-int(counts[ex]) // bm))]
    used = len(want_blocks)
    assert g.block_expert[:used].tolist() == want_blocks
    assert (g.block_expert[used:] == -1).all() and (g.block_rows[used:] == 0).all()
    rows = torch.arange(bm)[None, :] < g.block_rows[:, None]
    ids = g.token_ids[rows.reshape(-1)].long()
    # every assignment exactly once, grouped by expert in id order, in order within an expert
    assert torch.equal(ids, torch.sort(flat, stable=True).indices)
    for ex in range(e):  # full blocks then one partial one
        r = g.block_rows[g.block_expert == ex].tolist()
        assert sum(r) == counts[ex] and all(x == bm for x in r[:-1])


def test_worst_case_block_count_is_reached() -> None:
    # n assignments spread one per expert over min(E, n) experts: one block each
    idx = torch.arange(12).reshape(6, 2)
    assert max_blocks(12, 16, 16) == 12
    assert int((group_by_expert(idx, 16, 16).block_rows > 0).sum()) == 12
    assert max_blocks(0, 8, 16) == 0
    g = group_by_expert(torch.zeros(0, 2, dtype=torch.long), 8, 16)
    assert g.token_ids.numel() == 0 and g.block_expert.numel() == 0
