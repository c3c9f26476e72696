"""The fused mHC pre kernels (kernels/triton_mhc.py) against the torch path they replace on fresh
random inputs: merge_streams of the sub-layer before, HyperConnection.forward (stream mix, gates
with Sinkhorn, collapse) and the sub-layer's RMSNorm. Quick tier: 1 and 300 tokens at a small
and at DeepSeek-V4's hidden size; gpu_full: the others.

And the gates kernel of long prefill chunks (`hc_gates`) against HyperConnection.gates.

Tolerances: post and comb are fp32 functions of the mix, whose dot products the kernel adds in
another order (fixed slices of the hidden dim): a few fp32 ulps, kept through 20 Sinkhorn
iterations of normalisations that are well conditioned (entries >= eps) -> rtol 1e-4 (1e-3,
and 1e-4 absolute on values in [0, 2], when the mix reads merged bf16 streams, which may
differ by an ulp: measured 1e-5 at most at 300 tokens). Outputs in bf16 are
rounded from fp32 values a few ulps apart, so a value next to a rounding boundary may land an
ulp away, and the normed input is rounded twice (the collapse, then the norm): see
`_assert_close`.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiered

from kvrelay.kernels.triton_mhc import hc_gates, hc_pre
from kvrelay.models.deepseek_v4.mhc import HyperConnection, merge_streams
from kvrelay.models.deepseek_v4.norms import RMSNorm

pytestmark = pytest.mark.gpu

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1 only


def _modules(d: int) -> tuple[HyperConnection, RMSNorm]:
    hc = HyperConnection(4, d, 20, 1e-6, 1e-6).to(DEV)
    norm = RMSNorm(d, 1e-6).to(DEV)
    with torch.no_grad():
        hc.fn.normal_(0, d**-0.5)
        hc.base.normal_()
        hc.scale.uniform_(0.5, 2.0)
        norm.weight.uniform_(0.5, 1.5)
    return hc, norm


def _inputs(t: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    streams = torch.randn(t, 4, d, generator=g, device=DEV).to(dtype)
    out = torch.randn(t, d, generator=g, device=DEV).to(dtype)
    post = torch.rand(t, 4, generator=g, device=DEV) * 2
    comb = torch.rand(t, 4, 4, generator=g, device=DEV)
    comb = comb / comb.sum(dim=1, keepdim=True)
    return streams, (out, post, comb)


def _reference(hc, norm, streams, pending):
    if pending is not None:
        streams = merge_streams.eager(pending[0], streams, pending[1], pending[2])
    h, post, comb = hc(streams)
    return streams, norm(h), post, comb


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: a few ulps. bf16: within 2 bf16 ulps (one is <= 2^-7 of the value) of each value or
    of its row's RMS (a sum of bf16 terms that nearly cancel leaves a small value whose own
    ulp says nothing of the terms' rounding), and equal bits for nearly all values."""
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = got.float(), want.float()
    rms = w.square().mean(-1, keepdim=True).sqrt()
    if got.dtype == torch.float32:
        # The collapse adds 4 streams weighted by gates that are fp32 functions of the mix,
        # within rtol 1e-4 of the reference's (module docstring): where the terms nearly cancel
        # a value moves by that much of its row's scale, not of itself (measured on the H100:
        # 1.4e-5 on a value of 0.35 whose row's RMS is ~1).
        assert ((g - w).abs() <= 1e-4 * torch.maximum(w.abs(), rms)).all(), (g - w).abs().max()
        return
    assert ((g - w).abs() <= 2 * 2**-7 * torch.maximum(w.abs(), rms)).all(), (g - w).abs().max()
    assert (g != w).float().mean() < 0.05


@tiered("t", [1, 7, 33, 300], quick=[1, 300])
@pytest.mark.parametrize("d", [64, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("merge", [False, True])
def test_pre_equals_the_torch_path(t: int, d: int, dtype: torch.dtype, merge: bool) -> None:
    hc, norm = _modules(d)
    for seed in range(2):  # fresh draws each time
        streams, pending = _inputs(t, d, dtype, seed)
        pending = pending if merge else None
        with torch.no_grad():
            want = _reference(hc, norm, streams, pending)
            got = hc.pre_fused(hc_pre, streams, pending, norm)
        _assert_close(got[0], want[0])  # the merged streams
        _assert_close(got[1], want[1])  # the normed sub-layer input
        # post, comb: from the mix, whose inputs (merged bf16 streams) may differ by an ulp
        tol = (1e-3, 1e-4) if merge and dtype == torch.bfloat16 else (1e-4, 1e-6)
        for g, w in zip(got[2:], want[2:], strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=tol[0], atol=tol[1])


def test_a_row_alone_equals_the_row_in_a_batch() -> None:
    """The partial sums run over fixed hidden-dim slices: a token's outputs do not depend on
    how many tokens share the launch (identical bits)."""
    hc, norm = _modules(4096)
    streams, pending = _inputs(64, 4096, torch.bfloat16, 7)
    with torch.no_grad():
        batch = hc.pre_fused(hc_pre, streams, pending, norm)
        for row in (0, 17, 63):
            alone = hc.pre_fused(
                hc_pre, streams[row : row + 1], tuple(p[row : row + 1] for p in pending), norm
            )
            for a, b in zip(alone, batch, strict=True):
                assert torch.equal(a[0], b[row])


@tiered("t", [1, 7, 33, 300], quick=[1, 300])
def test_gates_equal_the_torch_reference(t: int) -> None:
    hc = HyperConnection(4, 64, 20, 1e-6, 1e-6).to(DEV)
    for _ in range(2):  # fresh draws each time
        with torch.no_grad():
            hc.base.normal_()
            hc.scale.uniform_(0.5, 2.0)
        mix = torch.randn(t, 24, device=DEV) * 3
        want = hc.gates(mix)
        got = hc_gates(mix, hc.scale, hc.base, 4, 20, 1e-6)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (g - w).abs().max()
