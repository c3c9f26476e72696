"""The compute-precision rule: reductions and small fp32 parameters run in fp32, or fp64 when
the whole model runs in fp64 (as the float64 oracle tests do). `wide_dtype` and `wide` live in
kvrelay.kernels.precision (the kernels' references follow the rule too); the model's weights
add `wide_weight`."""

from __future__ import annotations

import torch

from kvrelay.kernels.precision import wide, wide_dtype

__all__ = ["wide", "wide_dtype", "wide_weight"]


def wide_weight(w: torch.Tensor) -> torch.Tensor:
    """A weight in the wide dtype for the projections the reference runs in fp32 (compressor,
    router, indexer weights). The copy is kept on the weight and made again only when the
    weight changes in place (a load), so a step does not cast the same weight on every call."""
    wd = wide_dtype(w.dtype)
    if w.dtype == wd:
        return w
    key = (w.data_ptr(), w._version, w.device)
    cached = getattr(w, "_kvrelay_wide", None)
    if cached is None or cached[0] != key:
        cached = (key, w.detach().to(wd))
        w._kvrelay_wide = cached
    return cached[1]
