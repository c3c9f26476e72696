"""Triton kernels for the small per-token ops of a decoder layer, one launch each instead of
the 6-12 PyTorch launches they cost eagerly: (add +) RMSNorm, RoPE on q and k, SiLU-and-mul.
Semantics match kvrelay.kernels.reference (rms_norm, apply_rope, silu_and_mul); the only
difference is rounding: intermediates stay float32 and are rounded once at the end.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: importable, never called
    triton = None
    tl = None


def _jit(fn=None, *, varying=()):
    """triton.jit. `varying`: the integer arguments that change with a step's token or context
    count. Triton would compile a variant of the kernel for each of their classes (1, a multiple
    of 16, other), and a live prompt of a new class paid that compile (~0.3 s each, 2026-12-07,
    H200) after the warm-up; unspecialised, one compile serves every count."""
    if fn is None:
        return lambda f: _jit(f, varying=varying)
    if triton is None:
        return fn
    return triton.jit(fn, do_not_specialize=list(varying)) if varying else triton.jit(fn)


@_jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        # The sum is rounded to the activation dtype, as the unfused `x + residual` is.
        x = x.to(tl.float32) + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(
            tl.float32
        )
        x = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * n_cols + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    y = (x32 * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual); with a residual, x + residual is written into `residual` in place."""
    x = x.contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape
    _rms_norm_kernel[(x.numel() // n,)](
        x, residual if residual is not None else x, weight, out, n, eps,
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return out, (residual if residual is not None else x)


@_jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_t, HALF: tl.constexpr):
    # One program per (token, head): rotate the two halves of one head vector in place.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF)
    base = x_ptr + t * stride_t + h * (2 * HALF)
    x1 = tl.load(base + offs).to(tl.float32)
    x2 = tl.load(base + HALF + offs).to(tl.float32)
    c = tl.load(cos_ptr + t * (2 * HALF) + offs).to(tl.float32)
    s = tl.load(sin_ptr + t * (2 * HALF) + offs).to(tl.float32)
    tl.store(base + offs, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty))
    tl.store(base + HALF + offs, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place on x [T, H, D] whose heads are contiguous within a token (any token stride),
    e.g. the q and k heads of a fused qkv output in one launch; returns x."""
    assert (
        x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cos.is_contiguous()
        and sin.is_contiguous()
    )
    t, h, d = x.shape
    if t:
        _rope_kernel[(t, h)](x, cos, sin, x.stride(0), HALF=d // 2)
    return x


@_jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * n_cols + cols,
        (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    n = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    rows = x.numel() // (2 * n)
    block = 1024
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, BLOCK=block)
    return out


@_jit
def _rms_norm_wide_kernel(
    x_ptr, w_ptr, out_ptr, n_cols, x_stride, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_wide(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """DeepSeek-V4's RMS norm over the last dim in one launch: normalized and weighted in fp32,
    rounded once to x's dtype (reference: models/deepseek_v4/norms.py; the dense `rms_norm`
    above rounds before the weight, as Llama does). `weight` None: the unweighted per-head norm.
    Not for float64 (the oracle models), which the torch code serves."""
    if x.dtype == torch.float64:
        raise ValueError("rms_norm_wide: float64 runs the torch reference")
    n = x.shape[-1]
    # rows may be strided (a column slice of a fused projection's output): read in place
    x2 = x if x.dim() == 2 and x.stride(-1) == 1 else x.contiguous().view(-1, n)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    if x2.shape[0]:
        _rms_norm_wide_kernel[(x2.shape[0],)](
            x2, weight if weight is not None else x2, out, n, x2.stride(0), eps,
            HAS_W=weight is not None, BLOCK=block, num_warps=max(1, min(8, block // 256)),
        )  # fmt: skip
    return out.view(x.shape)
