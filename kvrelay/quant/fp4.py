"""FP4 e2m1: the value table, nibble packing, and the indexer's FP4 QAT simulation.

e2m1 code = s.ee.m (sign bit 3): magnitudes LUT[code & 7] = [0, .5, 1, 1.5, 2, 3, 4, 6], sign
(-1)^(code >> 3); code 8 is -0. There is no inf or NaN.

Packing: two codes per byte along the last (input, K) dim, **low nibble = even element**
(element 2k = byte & 0xF, element 2k+1 = byte >> 4). Source: shared/reference/deepseek-v4.md §6
(MXFP4 dequant of the native experts) and §7 (SGLang ``modelopt_quant.py`` l.780-797 for NVFP4);
HF transformers 5.24 ``Fp8Dequantize._unpack_fp4`` unpacks the same way.

Rounding to e2m1 is round-to-nearest, ties to the even code (what ``cvt.rn`` does on the GPU and
what the reference ``fp4_act_quant`` relies on): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
2.5 -> 2, 3.5 -> 4, 5 -> 4; magnitudes above 6 saturate to 6.

Indexer simulation (§2: Hadamard, then "FP4 e2m1 simulation with block 32"): per block of 32
along the last dim, ``amax = max(amax, 6 * 2^-126)``, ``s = 2^ceil(log2(amax * fp32(1/6)))``
(ue8m0), ``q = e2m1(clamp(x / s, -6, 6))``; rounding as described by the ports of the reference
``kernel.py::fp4_act_quant``.
"""

from __future__ import annotations

import torch

from kvrelay.quant.fp8_block import (
    UE8M0_BIAS,
    UE8M0_NAN,
    ScaleFormat,
    encode_ue8m0,
    exp2_exact,
    ue8m0_exponent_for,
    ue8m0_to_float,
)

E2M1_MAX = 6.0
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
# Midpoints between consecutive magnitudes; at an odd index the upper neighbour has the even code.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
INV_E2M1_MAX = torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32)
_ACT_AMAX_FLOOR = E2M1_MAX * 2.0**-126  # keeps the scale a normal float


def e2m1_lut(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 e2m1 values as float32, indexed by code."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes (any integer dtype, values 0..15) -> float32 values."""
    return e2m1_lut(codes.device)[codes.long() & 0xF]


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Float -> uint8 codes, nearest with ties to the even code, saturating at +-6.

    The sign bit follows ``signbit`` so -0.0 (and negatives that round to 0) give code 8. NaN has
    no e2m1 code: callers must reject or handle it (the quantizers in this package do).
    """
    a = x.float().abs()
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        code += (a >= mid) if i % 2 else (a > mid)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def _as_bytes(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype == torch.uint8:
        return packed
    if packed.dtype == torch.int8 or packed.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        return packed.view(torch.uint8)
    raise TypeError(f"packed e2m1 must be uint8, int8 or float4_e2m1fn_x2, got {packed.dtype}")


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., 2m] -> bytes [..., m] (uint8), element 2k in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dim must be even to pack two codes per byte, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., m] (uint8/int8/float4_e2m1fn_x2) -> codes [..., 2m] (uint8), low nibble first."""
    b = _as_bytes(packed)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def quantize_fp4_ue8m0(
    x: torch.Tensor, block: int = 32, scale_format: ScaleFormat = "e8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dim: (packed uint8 [..., K/2], ue8m0 scale [..., K // block]).

    Reference ``fp4_act_quant`` rounding (module docstring). K must be a multiple of ``block``
    (and so even). A block holding NaN or infinity gets scale byte 255, so it decodes to NaN.
    This is also the layout of the optional FP4 index-K cache entry (64 B e2m1 + 4 B ue8m0).
    """
    kdim = x.shape[-1]
    if kdim % block or block % 2:
        raise ValueError(f"last dim {kdim} must be a multiple of an even block, got {block}")
    xf = x.float().unflatten(-1, (kdim // block, block))
    amax = xf.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(amax)
    exponent = ue8m0_exponent_for(amax.clamp_min(_ACT_AMAX_FLOOR), INV_E2M1_MAX)
    exponent = torch.where(finite, exponent, UE8M0_NAN - UE8M0_BIAS)
    codes = encode_e2m1((xf / exp2_exact(exponent)).nan_to_num(0.0)).flatten(-2)
    return pack_e2m1(codes), encode_ue8m0(exponent.squeeze(-1), scale_format)


def dequantize_fp4_ue8m0(
    packed: torch.Tensor, scale: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp4_ue8m0`: e2m1 [..., K] * scale [..., K // block]."""
    vals = decode_e2m1(unpack_e2m1(packed))
    kdim = vals.shape[-1]
    if kdim % block or scale.shape != (*vals.shape[:-1], kdim // block):
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match {kdim} values with block {block}"
        )
    s = ue8m0_to_float(scale).to(vals.device).unsqueeze(-1)
    return (vals.unflatten(-1, (kdim // block, block)) * s).flatten(-2).to(dtype)


def fake_quant_fp4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Quantize-dequantize along the last dim (the indexer's QAT simulation); returns x's dtype."""
    packed, s = quantize_fp4_ue8m0(x, block, "uint8")
    return dequantize_fp4_ue8m0(packed, s, block, x.dtype)
