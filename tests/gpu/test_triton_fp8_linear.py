"""The FP8 block-scaled linear kernel against its torch reference (dequantize, then matmul in
fp32) on fresh random weights and activations on the GPU: decode and prefill row counts, split K,
ragged N and K, the grouped output projection, bf16 and fp32 activations.

Quick tier (`pytest -m gpu`): bf16 decode (split K) at a real shape, fp32 prefill at a ragged one,
the grouped projection once, batch invariance; gpu_full (`pytest -m gpu_full`): every row count x
shape x dtype."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiered

from kvrelay.kernels.triton_fp8_linear import fp8_linear, fp8_linear_reference
from kvrelay.quant.fp8_block import quantize_fp8_block, ue8m0_to_float

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _weights(rows: int, k: int):
    w = torch.randn(rows, k, device="cuda") * (k**-0.5)
    w[: rows // 3] *= 8.0  # blocks with different scales
    q, s = quantize_fp8_block(w)
    return q, ue8m0_to_float(s).cuda()


@tiered(
    "n,k,m,dtype",
    [
        (*nk, m, d)
        for d, m, nk in itertools.product(
            (torch.bfloat16, torch.float32),
            (1, 3, 16, 64, 200),
            ((512, 4096), (1024, 1024), (200, 300)),
        )
    ],
    quick=[(512, 4096, 1, torch.bfloat16), (200, 300, 200, torch.float32)],
    ids=lambda c: f"{c[0]}x{c[1]}-m{c[2]}-{str(c[3])[6:]}",
)
def test_matches_reference(dtype, m, n, k):
    q, s = _weights(n, k)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    out, ref = fp8_linear(x, q, s), fp8_linear_reference(x, q, s)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        out.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol
    )


@tiered("m", (1, 64, 300), quick=[64])
def test_grouped_projection(m):
    groups, rank, k = 8, 256, 512
    q, s = _weights(groups * rank, k)
    x = torch.randn(m, groups, k, device="cuda", dtype=torch.bfloat16)
    out, ref = fp8_linear(x, q, s, groups), fp8_linear_reference(x, q, s, groups)
    assert out.shape == (m, groups, rank)
    torch.testing.assert_close(
        out.float(), ref.float(), atol=2e-2 * ref.abs().max().item(), rtol=2e-2
    )


def test_same_result_in_any_batch():
    """Row i's output does not depend on which other rows share the call (fixed split order)."""
    q, s = _weights(1024, 4096)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    alone = torch.cat([fp8_linear(x[i : i + 1], q, s) for i in range(0, 64, 9)])
    batched = fp8_linear(x, q, s)[::9]
    torch.testing.assert_close(alone.float(), batched.float(), atol=2e-2, rtol=2e-2)
