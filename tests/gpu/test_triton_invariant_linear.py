"""The batch-invariant linear kernel (`--deterministic` on the GPU) against its torch reference on
fresh random inputs, and its point: a row's output has the same bits alone and inside batches of
2..256 rows with random neighbours, at any position.

Quick tier (`pytest -m gpu`): SmolLM2's MLP shape in bf16 with a bias, a ragged fp32 shape, and
the invariance sweep; gpu_full: every row count x shape x dtype. cuBLAS (`F.linear`) is reported
beside it, not asserted: whether it varies with the batch is the library's choice."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from conftest import tiered

from kvrelay.kernels.triton_invariant_linear import invariant_linear, invariant_linear_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@tiered(
    "n,k,m,dtype,bias",
    [
        (*nk, m, d, b)
        for d, m, nk, b in itertools.product(
            (torch.bfloat16, torch.float32),
            (1, 3, 16, 17, 64, 300),
            ((3072, 576), (576, 1536), (200, 300)),
            (False, True),
        )
    ],
    quick=[(3072, 576, 17, torch.bfloat16, True), (200, 300, 300, torch.float32, False)],
    ids=lambda c: f"{c[0]}x{c[1]}-m{c[2]}-{str(c[3])[6:]}{'-bias' if c[4] else ''}",
)
def test_matches_reference(n, k, m, dtype, bias):
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    out, ref = invariant_linear(x, w, b), invariant_linear_reference(x, w, b)
    assert out.dtype == dtype and out.shape == (m, n)
    # fp32 runs the dot in IEEE fp32; bf16 rounds the fp32 sum once, as the reference does.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_has_the_same_bits_in_any_batch(dtype):
    g = torch.Generator(device="cuda").manual_seed(11)
    n, k = 1536, 576
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dtype)
    row = torch.randn(1, k, device="cuda", generator=g).to(dtype)
    alone = invariant_linear(row, w)
    variant = []
    for m in (2, 3, 15, 16, 17, 31, 64, 65, 128, 200, 256):
        x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        at = int(torch.randint(m, (1,), device="cuda", generator=g))
        x[at] = row[0]
        assert torch.equal(invariant_linear(x, w)[at], alone[0]), (m, at)
        if not torch.equal(F.linear(x, w)[at], F.linear(row, w)[0]):
            variant.append(m)
    print(f"{dtype}: F.linear gave the row other bits at m = {variant}")
