"""The reference's quantisation simulations (QAT numerics) on the KV path, and the Hadamard rotation.

Private twins of `kvrelay.quant`'s `fake_quant_fp8_ue8m0` / `fake_quant_fp4` (same rounding and
scale rules, bit-identical on fp32 inputs), kept here because those compute in fp32 while the
float64 oracle tests run this model in fp64: both round a tensor to what the reference's FP8
KV cache and FP4 index keys would hold, and return it in the input dtype.
"""

from __future__ import annotations

import math

import torch

from kvrelay.kernels.triton_hadamard import hadamard_fp4 as hadamard_fp4_kernel
from kvrelay.models.deepseek_v4.fusion import fusable, glue_active
from kvrelay.models.deepseek_v4.precision import wide
from kvrelay.models.deepseek_v4.rope import apply_rope

_FP8_MAX = 448.0
_FP4_MAX = 6.0
# e2m1 magnitudes; midpoints between neighbours decide the rounding
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _ue8m0_scale(
    x: torch.Tensor, block: int, qmax: float, amax_floor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of `block` along the last dim and their power-of-two scales (amax / qmax rounded up)."""
    blocks = wide(x).unflatten(-1, (-1, block))
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=amax_floor)
    scale = torch.exp2(torch.ceil(torch.log2(amax / qmax)))
    # The estimate is exact with IEEE division and log2; compiled (approximate) division or
    # log2 can land one power of two off where amax / qmax is a power of two. Products of a
    # power of two and qmax are exact, so these two steps make it the smallest power of two
    # with scale * qmax >= amax in any case.
    scale = torch.where(scale * qmax < amax, scale * 2, scale)
    return blocks, torch.where(scale * (0.5 * qmax) >= amax, scale * 0.5, scale)


def fake_quant_fp8_ue8m0(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Round to FP8 e4m3 with one ue8m0 (power-of-two) scale per `block` values."""
    blocks, scale = _ue8m0_scale(x, block, _FP8_MAX, 1e-4)
    inv = 1.0 / scale  # exact (a power of two), and so is the product
    q = (blocks * inv).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).to(blocks.dtype)
    return (q * scale).flatten(-2).to(x.dtype)


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round |v| <= 6 to the nearest e2m1 value, ties to the even mantissa (as a cast would).
    The grid's step is 0.5 below 2, 1 below 4 and 2 up to 6, and torch.round rounds half to
    even, which on each step's grid is the even code; pure arithmetic (no table to copy to the
    device, so it can run inside a CUDA graph capture)."""
    mag = v.abs().clamp(max=_FP4_MAX)
    q = torch.where(
        mag < 2,
        torch.round(mag * 2) * 0.5,
        torch.where(mag < 4, torch.round(mag), torch.round(mag * 0.5) * 2),
    )
    return q * v.sign()


def fake_quant_fp4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Round to FP4 e2m1 with one ue8m0 scale per `block` values."""
    blocks, scale = _ue8m0_scale(x, block, _FP4_MAX, _FP4_MAX * 2.0**-126)
    return (_round_e2m1(blocks * (1.0 / scale)) * scale).flatten(-2).to(x.dtype)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform (Sylvester order) over the last dim, a power of two."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    y = wide(x)
    h = 1
    while h < n:
        y = y.unflatten(-1, (n // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * (1.0 / math.sqrt(n))).to(x.dtype)


@fusable
def rope_round_fp8(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nope_dim: int, qat: bool
) -> torch.Tensor:
    """A cache row [n, D] as the reference's cache holds it: rotated, and with QAT the nope dims
    rounded to FP8 (ue8m0 scale per 64) while the RoPE dims stay in the model dtype."""
    x = apply_rope.eager(x, cos, sin)
    if not qat:
        return x
    return torch.cat((fake_quant_fp8_ue8m0(x[:, :nope_dim], 64), x[:, nope_dim:]), 1)


def hadamard_fp4(x: torch.Tensor) -> torch.Tensor:
    """Index keys and queries as the reference's FP4 index cache sees them: Hadamard-rotated,
    then rounded to FP4 with a ue8m0 scale per 32. On the fast path one Triton launch
    (`kernels/triton_hadamard.py`, exact by construction) replaces the ~40 eager ones; not
    torch.compile: compiled, ~0.5% of the codes of bf16 inputs came out one step off the eager
    rounding, and these codes decide the indexer's top-k."""
    if glue_active(x) and x.dtype in (torch.float32, torch.bfloat16):
        return hadamard_fp4_kernel(x)
    return hadamard_fp4_eager(x)


def hadamard_fp4_eager(x: torch.Tensor) -> torch.Tensor:
    """The torch reference of `hadamard_fp4` (and its kernel's test oracle)."""
    return fake_quant_fp4(hadamard(x), 32)
