"""Triton RMSNorm (+ residual), RoPE and SiLU-and-mul against their torch references.

Quick tier (`pytest -m gpu`): each kernel in bf16 and fp32 at one shape each; gpu_full
(`pytest -m gpu_full`): every shape x dtype (x residual / weight) combination."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiered

from kvrelay.kernels import reference as ref

pytestmark = pytest.mark.gpu
BF16, FP32 = (torch.bfloat16, 1e-2), (torch.float32, 1e-6)  # (dtype, tol)


def _name(dtype: torch.dtype) -> str:
    return str(dtype)[6:]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@tiered(
    "dtype,tol,rows,n,with_residual",
    [
        (*d, *s, r)
        for d, s, r in itertools.product(
            (FP32, BF16), [(1, 576), (37, 2048), (300, 4096), (5, 64)], (False, True)
        )
    ],
    quick=[(*BF16, 300, 4096, True), (*FP32, 5, 64, False)],
    ids=lambda c: f"{_name(c[0])}-{c[2]}x{c[3]}{'-residual' if c[4] else ''}",
)
def test_rms_norm(dtype, tol, rows, n, with_residual):
    from kvrelay.kernels import triton_pointwise as tp

    x = torch.randn(rows, n, device="cuda", dtype=dtype)
    w = torch.randn(n, device="cuda", dtype=dtype)
    res = torch.randn(rows, n, device="cuda", dtype=dtype) if with_residual else None
    want, want_res = ref.rms_norm(x, w, 1e-5, res)
    got, got_res = tp.rms_norm(x, w, 1e-5, None if res is None else res.clone())
    assert _rel(got, want) < tol
    assert torch.equal(got_res, want_res)  # the residual sum is rounded exactly like x + res


@tiered(
    "dtype,tol,t,h,d",
    [
        (*dt, *s)
        for dt, s in itertools.product((FP32, BF16), [(1, 9, 64), (70, 32, 64), (513, 8, 128)])
    ],
    quick=[(*BF16, 70, 32, 64), (*FP32, 513, 8, 128)],
    ids=lambda c: f"{_name(c[0])}-t{c[2]}-h{c[3]}-d{c[4]}",
)
def test_rope_on_a_fused_qkv_view(dtype, tol, t, h, d):
    from kvrelay.kernels import triton_pointwise as tp

    qkv = torch.randn(t, (h + 2) * d, device="cuda", dtype=dtype)
    pos = torch.randint(0, 4096, (t,), device="cuda")
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    f = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat((f, f), -1).cos().to(dtype), torch.cat((f, f), -1).sin().to(dtype)
    q = qkv[:, : h * d].view(t, h, d)  # a strided view, as the model passes it
    want = ref.apply_rope(q.clone(), cos, sin)
    untouched = qkv[:, h * d :].clone()
    got = tp.apply_rope(q, cos, sin)
    assert _rel(got, want) < tol
    assert torch.equal(qkv[:, h * d :], untouched)


@tiered(
    "dtype,tol,rows,i",
    [(*dt, *s) for dt, s in itertools.product((FP32, BF16), [(1, 1536), (64, 8192), (3, 100)])],
    quick=[(*BF16, 64, 8192), (*FP32, 3, 100)],
    ids=lambda c: f"{_name(c[0])}-{c[2]}x{c[3]}",
)
def test_silu_and_mul(dtype, tol, rows, i):
    from kvrelay.kernels import triton_pointwise as tp

    x = torch.randn(rows, 2 * i, device="cuda", dtype=dtype)
    out = tp.silu_and_mul(x)
    assert out.shape == (rows, i)
    assert _rel(out, ref.silu_and_mul(x)) < tol


@tiered(
    "dtype,shape,weighted",
    list(
        itertools.product(
            (torch.float32, torch.bfloat16),
            [(1, 4096), (64, 1024), (3, 64, 512), (300, 160), (7, 33)],
            (False, True),
        )
    ),
    quick=[(torch.bfloat16, (3, 64, 512), True), (torch.float32, (300, 160), False)],
    ids=lambda c: f"{_name(c[0])}-{'x'.join(map(str, c[1]))}{'-weighted' if c[2] else ''}",
)
def test_rms_norm_wide_matches_deepseek_v4_norms(dtype, shape, weighted):
    """DeepSeek-V4's norms (weight applied in fp32, one rounding): the fused kernel against
    `RMSNorm` / `HeadNorm` in torch on fresh random inputs; bf16 outputs at most one rounding
    step apart (a different fp32 summation order), fp32 to 1e-6."""
    from kvrelay.kernels import triton_pointwise as tp
    from kvrelay.models.deepseek_v4.norms import HeadNorm, RMSNorm

    x = (torch.randn(shape, device="cuda") * 3 + 0.5).to(dtype)
    norm = RMSNorm(shape[-1], 1e-6, dtype).cuda() if weighted else HeadNorm(1e-6)
    if weighted:
        with torch.no_grad():
            norm.weight.copy_(torch.randn(shape[-1], device="cuda"))
    want = norm(x)
    norm.kernel = tp.rms_norm_wide
    got = norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        assert _rel(got, want) < 1e-6
    else:
        ulp = want.float().abs() * 2**-7 + 1e-30
        assert ((got.float() - want.float()).abs() <= ulp).all()
        assert (got == want).float().mean() > 0.98
