"""Triton RMSNorm (+ residual), RoPE and SiLU-and-mul against their torch references."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kernels import reference as ref

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows,n", [(1, 576), (37, 2048), (300, 4096), (5, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, tol, rows, n, with_residual):
    from kvrelay.kernels import triton_pointwise as tp

    x = torch.randn(rows, n, device="cuda", dtype=dtype)
    w = torch.randn(n, device="cuda", dtype=dtype)
    res = torch.randn(rows, n, device="cuda", dtype=dtype) if with_residual else None
    want, want_res = ref.rms_norm(x, w, 1e-5, res)
    got, got_res = tp.rms_norm(x, w, 1e-5, None if res is None else res.clone())
    assert _rel(got, want) < tol
    assert torch.equal(got_res, want_res)  # the residual sum is rounded exactly like x + res


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("t,h,d", [(1, 9, 64), (70, 32, 64), (513, 8, 128)])
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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows,i", [(1, 1536), (64, 8192), (3, 100)])
def test_silu_and_mul(dtype, tol, rows, i):
    from kvrelay.kernels import triton_pointwise as tp

    x = torch.randn(rows, 2 * i, device="cuda", dtype=dtype)
    out = tp.silu_and_mul(x)
    assert out.shape == (rows, i)
    assert _rel(out, ref.silu_and_mul(x)) < tol
