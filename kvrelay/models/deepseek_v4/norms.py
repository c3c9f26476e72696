"""RMS norms: the weighted one (fp32 weight) and the unweighted per-head one."""

from __future__ import annotations

import torch
from torch import nn

from kvrelay.models.deepseek_v4.precision import wide, wide_dtype


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed wide, returned in x's dtype."""
    w = wide(x)
    return (w * torch.rsqrt(w.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMSNorm. The weight stays fp32 (fp64 in a fp64 model) and multiplies before the
    cast back, as the reference keeps norm weights in fp32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=wide_dtype(dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = wide(x)
        normed = w * torch.rsqrt(w.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(normed.dtype) * normed).to(x.dtype)
