"""NVFP4 dequantization in one pass: packed e2m1 bytes + e4m3 scale per 16 + fp32 global scale
per matrix -> bf16/fp32 weights. The torch reference (`kvrelay.quant.nvfp4.dequantize_nvfp4`)
takes about ten full-size passes through float32 intermediates; this reads each byte once and
writes each weight once, multiplying in the reference's order (e2m1 * scale, exact in float32,
then * global scale) so the result is bit-identical.
"""

from __future__ import annotations

import torch

from kvrelay.kernels.triton_pointwise import _jit, tl, triton
from kvrelay.quant.nvfp4 import NVFP4_BLOCK

BYTES_PER_PROGRAM = 1024  # 2048 weights of one row


@_jit
def _dequant_kernel(
    packed_ptr, scale_ptr, gs_ptr, out_ptr, rows_per_matrix, half_k, n_scales,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # byte index within the row
    mask = kb < half_k
    b = tl.load(packed_ptr + row * half_k + kb, mask=mask, other=0).to(tl.int32)
    # One e4m3 scale covers 16 weights = 8 bytes.
    s = tl.load(scale_ptr + row * n_scales + kb // 8, mask=mask, other=0)
    s = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    gs = tl.load(gs_ptr + row // rows_per_matrix)
    for nibble in tl.static_range(2):  # element 2k is the low nibble of byte k
        c = (b >> (4 * nibble)) & 15
        e = (c >> 1) & 3
        f = (c & 1).to(tl.float32)
        # e2m1 magnitude: 0.5 * f when the exponent is 0, else (1 + f / 2) * 2^(e - 1)
        pow2 = tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0))
        mag = tl.where(e == 0, 0.5 * f, (1.0 + 0.5 * f) * pow2)
        v = tl.where(c >= 8, -mag, mag)
        w = (v * s) * gs
        tl.store(out_ptr + row * 2 * half_k + 2 * kb + nibble, w.to(out_ptr.dtype.element_ty), mask)


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale_e4m3: torch.Tensor,
    weight_scale_2: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Packed [..., N, K/2] uint8 + scales [..., N, K/16] e4m3 + global scales (one per leading
    index, or one) -> [..., N, K] in `dtype`, on the GPU. K must be a multiple of 16."""
    *lead, n, half_k = packed.shape
    k = 2 * half_k
    if k % NVFP4_BLOCK or tuple(block_scale_e4m3.shape) != (*lead, n, k // NVFP4_BLOCK):
        raise ValueError(
            f"scales {tuple(block_scale_e4m3.shape)} do not fit packed {tuple(packed.shape)}"
        )
    matrices = 1
    for d in lead:
        matrices *= d
    gs = weight_scale_2.to(device=packed.device, dtype=torch.float32).reshape(-1)
    if gs.numel() == 1:
        gs = gs.expand(matrices).contiguous()
    if gs.numel() != matrices:
        raise ValueError(f"{gs.numel()} global scales for {matrices} matrices")
    out = torch.empty(*lead, n, k, dtype=dtype, device=packed.device)
    scale = block_scale_e4m3.contiguous().view(torch.uint8)
    grid = (matrices * n, triton.cdiv(half_k, BYTES_PER_PROGRAM))
    _dequant_kernel[grid](
        packed.contiguous(), scale, gs, out, n, half_k, k // NVFP4_BLOCK, BLOCK=BYTES_PER_PROGRAM
    )
    return out
