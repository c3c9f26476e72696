"""The Hadamard + FP4 kernel (kernels/triton_hadamard.py) equals the eager torch reference
(`qat.hadamard_fp4_eager`) bit for bit, on fresh random inputs whose rows span twelve orders of
magnitude, plus rows of zeros, rows with one value far above the rest and values on FP4
rounding ties: the indexer's top-k follows these codes, so "close" is not enough."""

from __future__ import annotations

import pytest
import torch
from conftest import tiered

from kvrelay.kernels.triton_hadamard import hadamard_fp4
from kvrelay.models.deepseek_v4.qat import hadamard_fp4_eager as reference

pytestmark = pytest.mark.gpu

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1 only


def _rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    n = shape[-1]
    x = torch.randn(*shape, generator=g, device=DEV).view(-1, n)
    x = x * 10.0 ** (torch.rand(x.shape[0], 1, generator=g, device=DEV) * 12 - 6)
    if x.shape[0] >= 4:
        x[0] = 0.0  # all zero: the amax floor
        x[1, 5] = 1e4  # one value far above the rest of its blocks
        # the Hadamard of a spike at index 0 is constant: every value on one scale's grid
        x[2] = 0.0
        x[2, 0] = 6.0 * n**0.5
        x[3] = x[3].round() * 0.25  # many exact ties after the rotation
    return x.view(shape).to(dtype)


@tiered("shape", [(1, 64, 128), (7, 128), (33, 64, 128), (300, 64, 128), (5, 8, 64)],
        quick=[(1, 64, 128), (300, 64, 128)], ids=lambda s: "x".join(map(str, s)))  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_the_eager_reference_bit_for_bit(shape, dtype) -> None:
    for seed in range(3):
        x = _rows(shape, dtype, seed)
        got, want = hadamard_fp4(x), reference(x)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), (got != want).float().mean()
