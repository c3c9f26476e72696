"""Tensor-parallel building blocks: the TP group handle, column/row-parallel linears, the
vocab-parallel embedding and LM head.

A world of 1 is the plain model: every layer below is then an `nn.Linear` / `nn.Embedding` with
no collective and no extra copy. With world N (torch.distributed: NCCL on GPU, gloo on CPU):
- column-parallel: each rank holds a slice of the output features; its output stays local.
- row-parallel: each rank holds the matching slice of the input features; outputs are partial
  sums, all-reduced.
- vocab-parallel: each rank holds ceil(V / N) rows of the vocabulary (the last rank's tail is
  zero padding); lookups are masked and all-reduced, logits are all-gathered and cut back to V.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class TPGroup:
    """This process's place in the tensor-parallel group. World 1: no collectives at all."""

    def __init__(self, rank: int = 0, world: int = 1, group=None) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world}")
        self.rank, self.world, self.group = rank, world, group

    @classmethod
    def from_default(cls, world: int) -> TPGroup:
        """World 1, or the already initialised default torch.distributed group of `world`."""
        if world == 1:
            return cls()
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                f"tensor parallel size {world} needs torch.distributed initialised in every rank"
            )
        if dist.get_world_size() != world:
            raise ValueError(
                f"tensor parallel size {world} != torch.distributed world {dist.get_world_size()}"
            )
        return cls(dist.get_rank(), world)

    @property
    def is_parallel(self) -> bool:
        return self.world > 1

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN}
        dist.all_reduce(x, op=ops[op], group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dim, in rank order."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def gather(self, x: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's `x` (one shape on every rank) on rank `dst`, in rank order; None elsewhere."""
        import torch.distributed as dist

        if not self.is_parallel:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == dst else None
        dist.gather(x.contiguous(), parts, dst=dst, group=self.group)
        return parts

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        import torch.distributed as dist

        dist.broadcast(x, src, group=self.group)
        return x

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (e.g. KV pages every rank can hold)."""
        if not self.is_parallel:
            return value
        return int(self.all_reduce(torch.tensor([value], dtype=torch.int64), "min").item())

    def split(self, size: int, what: str) -> int:
        """This rank's share of `size` items that must split evenly (heads, features)."""
        if size % self.world:
            raise ValueError(
                f"{what} ({size}) must be divisible by the tensor parallel size ({self.world})"
            )
        return size // self.world


SINGLE = TPGroup()


class ColumnParallelLinear(nn.Linear):
    """y = x W_r^T: this rank's output features (its heads, its half of gate and of up)."""

    def __init__(self, in_features: int, out_local: int, bias: bool = False) -> None:
        super().__init__(in_features, out_local, bias=bias)


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_r W_r^T: this rank holds its slice of the input features."""

    def __init__(self, in_local: int, out_features: int, tp: TPGroup, bias: bool = False) -> None:
        super().__init__(in_local, out_features, bias=bias)
        if bias and tp.is_parallel:
            raise NotImplementedError("a row-parallel bias would be added once per rank")
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return self.tp.all_reduce(y) if self.tp.is_parallel else y


def vocab_shard(vocab: int, tp: TPGroup) -> tuple[int, int]:
    """(first id, rows per rank) of this rank's vocabulary slice (rows past V are padding)."""
    rows = math.ceil(vocab / tp.world)
    return tp.rank * rows, rows


class VocabParallelEmbedding(nn.Embedding):
    """Each rank looks up the ids in its slice (others read as zero); the sum is the embedding."""

    def __init__(self, vocab: int, dim: int, tp: TPGroup) -> None:
        self.start, rows = vocab_shard(vocab, tp)
        # Values always come from a checkpoint or the dummy init: skip nn.Embedding's random
        # init (its first normal_ on meta tensors costs ~2 s of torch imports per process).
        super().__init__(rows, dim, _weight=torch.empty(rows, dim))
        self.tp, self.vocab = tp, vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab: int, tp: TPGroup):
    """Float32 logits [T, V] on every rank: local logits of this rank's rows, all-gathered."""
    logits = F.linear(hidden, weight).float()
    if not tp.is_parallel:
        return logits
    return tp.all_gather_last(logits)[:, :vocab]
