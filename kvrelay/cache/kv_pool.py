"""The paged K/V tensors of every layer of a dense model, allocated from its cache spec."""

from __future__ import annotations

import torch

from kvrelay.cache.spec import PAGE, CacheSpec, KindSpec, zeroed

__all__ = ["KVPool", "kv_cache_spec", "zeroed"]


def kv_cache_spec(
    num_layers: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
    shard: tuple[int, int] = (0, 1),
) -> CacheSpec:  # fmt: skip
    """Each layer's paged K and V, [page_size, kv_heads, head_dim] a page (`kv_heads`: this
    rank's, part `shard` of the model's)."""
    shape = (page_size, kv_heads, head_dim)
    kinds = tuple(
        KindSpec(f"L{i}.{name}", PAGE, i, shape, dtype, shard=shard)
        for i in range(num_layers)
        for name in ("k", "v")
    )
    return CacheSpec(page_size, kinds)


class KVPool:
    def __init__(self, spec: CacheSpec, num_pages: int, device: torch.device) -> None:
        self.spec, self.num_pages, self.page_size = spec, num_pages, spec.page_size
        self.tensors = spec.allocate(num_pages, 0, device)
        # One (k, v) pair per layer: [num_pages, page_size, kv_heads, head_dim].
        n = len(spec.kinds) // 2
        self.layers = [(self.tensors[f"L{i}.k"], self.tensors[f"L{i}.v"]) for i in range(n)]
