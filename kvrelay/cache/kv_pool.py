"""The paged K/V tensors of every layer, and how many pages fit in the memory we may use."""

from __future__ import annotations

import torch

from kvrelay.config import ModelConfig


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class KVPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype, device) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        shape = (2, cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        # One (k, v) view pair per layer: [num_pages, page_size, kv_heads, head_dim].
        self.layers = [(self.buffer[0, i], self.buffer[1, i]) for i in range(cfg.num_layers)]
