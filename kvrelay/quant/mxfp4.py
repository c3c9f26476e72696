"""DeepSeek-native MXFP4 routed experts: packed e2m1 + one ue8m0 scale per 32 inputs.

Checkpoint facts (shared/reference/deepseek-v4.md §6; config ``expert_dtype "fp4"``):
- ``layers.N.ffn.experts.E.w1/w3.weight``: I8 [2048, 2048] = packed e2m1, logical [2048, 4096];
  ``.scale``: F8_E8M0 [2048, 128], one per 32 along K (the input dim).
- ``w2.weight``: I8 [4096, 1024] (logical [4096, 2048]); ``w2.scale`` [4096, 64].
- The NVFP4 checkpoint keeps the ``mtp.*`` experts in this format (§7).
- Dequant: low nibble = even element; w = LUT[code & 7] * (-1)^(code >> 3) * 2^(e - 127).

The quantizer (for tests and tiny checkpoints; the real one is not published) picks per block the
smallest power of two that needs no clipping, s = 2^ceil(log2(amax * fp32(1/6))).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrelay.quant.fp4 import (
    E2M1_MAX,
    INV_E2M1_MAX,
    decode_e2m1,
    encode_e2m1,
    pack_e2m1,
    unpack_e2m1,
)
from kvrelay.quant.fp8_block import (
    UE8M0_BIAS,
    ScaleFormat,
    check_finite,
    encode_ue8m0,
    exp2_exact,
    ue8m0_exponent_for,
    ue8m0_to_float,
)

MXFP4_BLOCK = 32
# Below this amax the exponent clamps at 2^-127; flooring keeps amax * (1/6) from underflowing.
_AMAX_FLOOR = E2M1_MAX * 2.0**-UE8M0_BIAS


def dequantize_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Packed [..., N, K/2] (int8/uint8) + scales [..., N, ceil(K/32)] -> [..., N, K] in ``dtype``.

    Scales may be ``float8_e8m0fnu``, uint8 exponent bytes or float multipliers. A scale byte of
    255 (NaN) turns its 32 outputs into NaN. The product is exact in float32 (and in bf16 unless
    it leaves bf16's exponent range).
    """
    if packed.ndim < 2:
        raise ValueError(f"packed weight must be at least 2-D, got shape {tuple(packed.shape)}")
    vals = decode_e2m1(unpack_e2m1(packed))
    kdim = vals.shape[-1]
    expected = (*vals.shape[:-1], -(-kdim // MXFP4_BLOCK))
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"scales shape {tuple(scales.shape)} does not match packed {tuple(packed.shape)} "
            f"(expected {expected})"
        )
    s = ue8m0_to_float(scales).to(vals.device).repeat_interleave(MXFP4_BLOCK, dim=-1)[..., :kdim]
    return (vals * s).to(dtype)


def quantize_mxfp4(
    w: torch.Tensor,
    scale_format: ScaleFormat = "e8m0",
    packed_dtype: torch.dtype = torch.int8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float weight (K even) -> (packed [..., N, K/2], scales [..., N, ceil(K/32)]).

    ``packed_dtype`` int8 matches the checkpoint's I8 tensors; uint8 gives the same bytes. An
    all-zero block gets scale 1 (byte 127). Values already on a block's e2m1 * 2^e grid come back
    exactly. Non-finite input is rejected.
    """
    if w.ndim < 2 or w.shape[-1] % 2:
        raise ValueError(f"weight must be at least 2-D with an even last dim, got {tuple(w.shape)}")
    if packed_dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"packed_dtype must be int8 or uint8, got {packed_dtype}")
    check_finite(w, "weight")
    kdim = w.shape[-1]
    nblocks = -(-kdim // MXFP4_BLOCK)
    wf = F.pad(w.float(), (0, nblocks * MXFP4_BLOCK - kdim)).unflatten(-1, (nblocks, MXFP4_BLOCK))
    amax = wf.abs().amax(dim=-1, keepdim=True)
    exponent = ue8m0_exponent_for(amax.clamp_min(_AMAX_FLOOR), INV_E2M1_MAX)
    exponent = torch.where(amax == 0, 0, exponent.clamp(-UE8M0_BIAS, UE8M0_BIAS))
    codes = encode_e2m1(wf / exp2_exact(exponent)).flatten(-2)[..., :kdim]
    return pack_e2m1(codes).view(packed_dtype), encode_ue8m0(exponent.squeeze(-1), scale_format)
