"""The indexer's Hadamard rotation + FP4 rounding (`models/deepseek_v4/qat.hadamard_fp4`, the
reference) in one launch per call, bit for bit what the eager torch code gives.

Eagerly it is ~40 launches per call (seven butterfly stages of add, sub and stack, then the
block scale and the e2m1 rounding), and a batch-1 decode step of dsv4-mini makes 18 calls.
Compiled by torch.compile it came out one FP4 step off in ~0.5% of the codes of bf16 inputs,
and these codes decide the indexer's top-k. So every step here is exact by construction: the
butterflies add and subtract the same pairs in the same order (correctly rounded fp32 ops),
the ue8m0 scale is the smallest power of two with scale * 6 >= amax (built from its exponent
bits, then corrected as the reference does, so an approximate log2 cannot move it), the
reciprocal of a power of two and the products by it are exact, and the e2m1 rounding is
round-half-to-even by the 2^23 addition trick (exact for the magnitudes 0..12 it sees).
"""

from __future__ import annotations

import math

import torch

from kvrelay.kernels.triton_pointwise import _jit, tl, triton

BLOCK_ROWS = 16
FP4_BLOCK = 32  # values per ue8m0 scale
_FP4_MAX = 6.0
_AMAX_FLOOR = 6.0 * 2.0**-126


@_jit
def _rne_small(m):
    """Round 0 <= m < 2^22 to the nearest integer, ties to even (fp32 addition rounds so)."""
    return (m + 8388608.0) - 8388608.0


@_jit(varying=("rows",))
def _hadamard_fp4_kernel(
    x_ptr, out_ptr, rows, inv_sqrt_n, amax_floor,
    N: tl.constexpr, LOG2N: tl.constexpr, BR: tl.constexpr, QB: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.arange(0, N)
    m = (r < rows)[:, None]
    offs = r.to(tl.int64)[:, None] * N + c[None, :]
    y = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    for s in tl.static_range(LOG2N):  # stage h = 2^s: (y[i], y[i + h]) -> (sum, difference)
        y4 = tl.permute(tl.reshape(y, [BR, N // (2 << s), 2, 1 << s]), (0, 1, 3, 2))
        a, b = tl.split(y4)
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [BR, N])
    # the rotation in the input dtype, as the reference returns it, then FP4 per 32 values
    y = (y * inv_sqrt_n).to(out_ptr.dtype.element_ty).to(tl.float32)
    blocks = tl.reshape(y, [BR, N // QB, QB])
    amax = tl.maximum(tl.max(tl.abs(blocks), axis=2), amax_floor)
    e = tl.ceil(tl.log2(tl.div_rn(amax, 6.0))).to(tl.int32)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)  # 2^e exactly
    scale = tl.where(scale * 6.0 < amax, scale * 2.0, scale)
    scale = tl.where(scale * 3.0 >= amax, scale * 0.5, scale)
    v = blocks * tl.div_rn(1.0, scale)[:, :, None]
    mag = tl.minimum(tl.abs(v), 6.0)
    q = tl.where(
        mag < 2.0,
        _rne_small(mag * 2.0) * 0.5,
        tl.where(mag < 4.0, _rne_small(mag), _rne_small(mag * 0.5) * 2.0),
    )
    q = q * tl.where(v > 0, 1.0, tl.where(v < 0, -1.0, 0.0))  # torch.sign
    out = tl.reshape(q * scale[:, :, None], [BR, N])
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=m)


def hadamard_fp4(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a power of two, >= 32; fp32 or bf16) -> Hadamard-rotated and FP4-rounded
    with a ue8m0 scale per 32 values, in x's dtype: equal to `qat.hadamard_fp4(x)`."""
    n = x.shape[-1]
    if x.dtype == torch.float64:
        raise ValueError("hadamard_fp4: float64 runs the torch reference")
    if n & (n - 1) or n < FP4_BLOCK:
        raise ValueError(f"hadamard_fp4: size {n} is not a power of two >= {FP4_BLOCK}")
    x2 = x.contiguous().view(-1, n)
    out = torch.empty_like(x2)
    rows = x2.shape[0]
    if rows:
        _hadamard_fp4_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
            x2, out, rows, 1.0 / math.sqrt(n), _AMAX_FLOOR,
            N=n, LOG2N=n.bit_length() - 1, BR=BLOCK_ROWS, QB=FP4_BLOCK, num_warps=4,
        )  # fmt: skip
    return out.view(x.shape)
