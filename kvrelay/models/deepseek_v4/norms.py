"""RMS norms: the weighted one (fp32 weight) and the unweighted per-head one. Both run in
torch (the reference, and the CPU path) unless the runner gives them a fused kernel with
`use_norm_kernel` (the fast path on the GPU: one launch instead of ~8)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvrelay.models.deepseek_v4.precision import wide, wide_dtype

# (x, weight or None, eps) -> normalized x in x's dtype, as `rms_normalize` / `RMSNorm`
NormKernel = Callable[[torch.Tensor, torch.Tensor | None, float], torch.Tensor]


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
        self.kernel: NormKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype != torch.float64:
            return self.kernel(x, self.weight, self.eps)
        w = wide(x)
        normed = w * torch.rsqrt(w.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(normed.dtype) * normed).to(x.dtype)


class HeadNorm(nn.Module):
    """The unweighted RMS norm of each head vector (no parameters)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.kernel: NormKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype != torch.float64:
            return self.kernel(x, None, self.eps)
        return rms_normalize(x, self.eps)


def use_norm_kernel(model: nn.Module, kernel: NormKernel | None) -> None:
    """Route every norm of `model` through `kernel` (None: back to torch)."""
    for m in model.modules():
        if isinstance(m, RMSNorm | HeadNorm):
            m.kernel = kernel
