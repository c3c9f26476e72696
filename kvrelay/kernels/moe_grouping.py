"""Token grouping for the fused MoE, in torch: the T*k (token, slot) assignments sorted by
expert into blocks of BLOCK_M rows, every shape fixed by (T*k, E, BLOCK_M) alone so that it
captures in a CUDA graph (no host syncs). The torch reference of the Triton grouping kernel in
`triton_moe.py`, and the path used for large batches.

Layout (`Grouping`), for n = T*k assignments, assignment a = t*k + slot:
- expert e owns ceil(count_e / BLOCK_M) consecutive blocks, experts in id order; empty experts
  own none;
- `token_ids[b*BLOCK_M + r]` is the assignment in row r of block b, assignments of one expert in
  increasing order; only rows r < `block_rows[b]` are defined (the rest is never read);
- `block_expert[b]` is the expert of block b, -1 past the last used block;
- `block_rows[b]` is the number of rows in use (1..BLOCK_M), 0 past the last used block.
The buffers hold `max_blocks(n, E, BLOCK_M)` blocks, the worst case over every routing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Grouping(NamedTuple):
    token_ids: torch.Tensor  # int32 [max_blocks * block_m]
    block_expert: torch.Tensor  # int32 [max_blocks]
    block_rows: torch.Tensor  # int32 [max_blocks]


def max_blocks(n_assign: int, num_experts: int, block_m: int) -> int:
    """The most blocks any routing of n assignments over E experts can need: at most
    min(E, n) experts are used, each wasting at most block_m - 1 padded rows."""
    used = min(num_experts, n_assign)
    return (n_assign + used * (block_m - 1)) // block_m


def group_by_expert(idx: torch.Tensor, num_experts: int, block_m: int) -> Grouping:
    """idx [T, k] (any integer dtype, values in [0, E)) -> `Grouping`, on idx's device."""
    flat = idx.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    nb = max_blocks(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    blk_end = torch.cumsum(blocks, 0)
    blk_start = blk_end - blocks
    order = torch.sort(flat, stable=True).indices  # assignments by expert, in order within one
    sorted_e = flat[order]
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    rank = torch.arange(n, device=dev) - first[sorted_e]
    token_ids = torch.zeros(nb * block_m, dtype=torch.int32, device=dev)
    token_ids[blk_start[sorted_e] * block_m + rank] = order.to(torch.int32)
    b = torch.arange(nb, device=dev)
    e = torch.searchsorted(blk_end, b, right=True)  # E past the last used block
    used = e < num_experts
    e_safe = e.clamp(max=num_experts - 1)
    rows = (counts[e_safe] - (b - blk_start[e_safe]) * block_m).clamp(max=block_m)
    block_expert = torch.where(used, e, -1).to(torch.int32)
    block_rows = torch.where(used, rows, 0).to(torch.int32)
    return Grouping(token_ids, block_expert, block_rows)
