"""The paged K/V tensors of every layer, and how many pages fit in the memory we may use."""

from __future__ import annotations

import math

import numpy as np
import torch

from kvrelay.config import ModelConfig


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor. On CPU through calloc (numpy's zeros): a large block comes as
    fresh anonymous pages the OS zeroes on first touch, so a pool of several GB costs nothing
    until used (torch.zeros writes every byte up front: ~20 s at start for the default CPU pool
    on 2 cores)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class KVPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype, device) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        shape = (2, cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.buffer = zeroed(shape, dtype, device)
        # One (k, v) view pair per layer: [num_pages, page_size, kv_heads, head_dim].
        self.layers = [(self.buffer[0, i], self.buffer[1, i]) for i in range(cfg.num_layers)]
