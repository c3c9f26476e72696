"""Tensor-parallel split rules for DeepSeek-V4 weights (model/HF names), applied on load.

TP itself comes later; these rules fix how each tensor kind is cut so that a rank can load only
its part. Attention is split by heads, the output projection by groups, MoE by the intermediate
dim, the vocabulary by rows; everything tied to the single shared KV head stays whole.

| tensor (under model.layers.N. / model.mtp.K.)        | rule    | dim |
|------------------------------------------------------|---------|-----|
| self_attn.q_b_proj.weight [heads*hd, q_lora]         | column  | 0   |
| self_attn.sinks [heads]                              | column  | 0   |
| self_attn.o_a_proj.weight [groups*rank, heads*hd/g]  | column  | 0   |
| self_attn.o_b_proj.weight [hidden, groups*rank]      | row     | 1   |
| compressor.indexer.q_b_proj / scorer.weights_proj    | column  | 0   |
| mlp.shared_experts.gate_proj / up_proj               | column  | 0   |
| mlp.shared_experts.down_proj                         | row     | 1   |
| mlp.experts.gate_up_proj [E, 2I, hidden]             | gate_up | 1   |
| mlp.experts.down_proj [E, hidden, I]                 | row     | 2   |
| model.embed_tokens.weight, lm_head.weight            | column  | 0   |
| everything else (norms, mHC, q_a/kv projections,     | replicate |   |
| compressors, router, biases, tid2eid, ape)           |         |     |

`gate_up` splits the gate half and the up half separately and concatenates the two pieces,
so a rank's slice is again [gate_r; up_r]. Row-split outputs are partial sums (all-reduce).
The same cuts apply to packed FP4 tensors and their scales (the packed K dim is halved, the
scale dim divided by the block) when each rank's K range is a whole number of scale blocks.
"""

from __future__ import annotations

import re
from typing import Literal

import torch

Rule = tuple[Literal["replicate", "column", "row", "gate_up"], int]

_RULES: tuple[tuple[re.Pattern[str], Rule], ...] = tuple(
    (re.compile(p), rule)
    for p, rule in (
        (r"self_attn\.(q_b_proj\.weight|sinks|o_a_proj\.weight)", ("column", 0)),
        (r"self_attn\.o_b_proj\.weight", ("row", 1)),
        (r"self_attn\.compressor\.indexer\.q_b_proj\.weight", ("column", 0)),
        (r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.weight", ("column", 0)),
        (r"mlp\.shared_experts\.(gate_proj|up_proj)\.weight", ("column", 0)),
        (r"mlp\.shared_experts\.down_proj\.weight", ("row", 1)),
        (r"mlp\.experts\.gate_up_proj(_scale_inv)?", ("gate_up", 1)),
        (r"mlp\.experts\.down_proj(_scale_inv)?", ("row", 2)),
    )
)
_BLOCK = re.compile(r"model\.(?:layers|mtp)\.\d+\.(.+)")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def shard_rule(name: str) -> Rule:
    """How the tensor `name` is split across TP ranks: (kind, dim)."""
    if name in _VOCAB:
        return ("column", 0)
    m = _BLOCK.fullmatch(name)
    if m is not None:
        for pattern, rule in _RULES:
            if pattern.fullmatch(m.group(1)):
                return rule
    return ("replicate", 0)


Slice = tuple[int, int, int]  # (dim, start, stop)


def _part(size: int, dim: int, rank: int, world: int, name: str, offset: int = 0) -> Slice:
    if size % world:
        raise ValueError(f"{name}: dim {dim} of size {size} does not split over {world} ranks")
    per = size // world
    return dim, offset + rank * per, offset + (rank + 1) * per


def shard_slices(name: str, shape: tuple[int, ...], rank: int, world: int) -> list[Slice]:
    """Rank `rank`'s part of a tensor `name` of `shape` as slices concatenated along their dim
    (gate_up: the gate piece, then the up piece); [] means the whole tensor. A reader can fetch
    exactly these slices from a checkpoint."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    kind, dim = shard_rule(name)
    if kind == "replicate" or world == 1:
        return []
    if kind == "gate_up":
        half = shape[dim] // 2
        return [_part(half, dim, rank, world, name), _part(half, dim, rank, world, name, half)]
    return [_part(shape[dim], dim, rank, world, name)]


def take(tensor: torch.Tensor, slices: list[Slice]) -> torch.Tensor:
    """`tensor` cut to `slices` (as `shard_slices` gives them; a view when there is one)."""
    if not slices:
        return tensor
    parts = [tensor.narrow(d, a, b - a) for d, a, b in slices]
    return parts[0] if len(parts) == 1 else torch.cat(parts, slices[0][0])


def shard(name: str, tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s part of `tensor` (a view when possible; replicated tensors as they are)."""
    return take(tensor, shard_slices(name, tuple(tensor.shape), rank, world))


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every rank's part, in rank order (inverse of `shard`)."""
    kind, dim = shard_rule(name)
    if kind == "replicate" or len(shards) == 1:
        return shards[0]
    if kind == "gate_up":
        halves = [s.chunk(2, dim=dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
    return torch.cat(shards, dim)
