"""The compute-precision rule: reductions and small fp32 parameters run in fp32, or fp64 when
the whole model runs in fp64 (as the float64 oracle tests do). Here, below the kernels' torch
references, so that kernels, layers and models all follow the one rule."""

from __future__ import annotations

import torch


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(wide_dtype(x.dtype))
