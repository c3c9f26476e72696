"""The fused mHC pre kernels (kernels/triton_mhc.py) against the torch path they replace on fresh
random inputs: merge_streams of the sub-layer before, HyperConnection.forward (stream mix, gates
with Sinkhorn, collapse) and the sub-layer's RMSNorm. Quick tier: 1 and 300 tokens at a small
and at DeepSeek-V4's hidden size; gpu_full: the others.

Tolerances: post and comb are fp32 functions of the mix, whose dot products the kernel adds in
another order (fixed slices of the hidden dim): a few fp32 ulps, kept through 20 Sinkhorn
iterations of normalisations that are well conditioned (entries >= eps) -> rtol 1e-4. Outputs in
bf16 are rounded from fp32 values a few ulps apart, so a value next to a rounding boundary
may land one bf16 ulp (2^-8 to 2^-7 of the value) away: the merged streams at most 1 ulp, the
normed input (rounded twice: the collapse, then the norm) 2, each on a small share of values.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiered

from kvrelay.kernels.triton_mhc import hc_pre
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


def _assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int) -> None:
    """fp32: a few ulps; bf16: at most `ulps` bf16 ulps each (one is <= 2^-7 of the value), on
    a small share of the values."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    g, w = got.float(), want.float()
    ulp = w.abs().clamp(min=2**-126) * 2**-7
    assert ((g - w).abs() <= ulps * ulp).all(), (g - w).abs().max()
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
        _assert_within_ulps(got[0], want[0], 1)  # the merged streams
        # the normed input: h's own rounding (1 ulp) carried through the norm, then y's
        _assert_within_ulps(got[1], want[1], 2)
        for g, w in zip(got[2:], want[2:], strict=True):  # post, comb
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


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
