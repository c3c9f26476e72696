"""FP8 e4m3 with power-of-two (ue8m0) scales: block-128x128 weights and block-64 activations.

Checkpoint facts (shared/reference/deepseek-v4.md §1, §6, §7):
- config.json ``quantization_config``: fmt e4m3, scale_fmt ue8m0, weight_block_size [128, 128].
- Each FP8 linear weight ``X.weight`` (F8_E4M3, [N, K]) has ``X.scale`` (F8_E8M0, [ceil(N/128),
  ceil(K/128)]), e.g. wq_a [1024, 4096] -> scale [8, 32]; the NVFP4 checkpoint keeps these as they are.
- HF transformers 5.24 renames ``.scale`` to ``.weight_scale_inv`` and stores it either as
  ``float8_e8m0fnu`` or as float32 (DeepSeek-V3 style); despite the name it is the multiplier:
  ``w = e4m3 * scale`` (``integrations/finegrained_fp8.py::Fp8Dequantize``). Scales may also arrive
  as raw exponent bytes (uint8), meaning 2^(byte - 127).

Activation side (QAT simulation in the reference model, §2): the main KV's nope dims are quantized
and dequantized with e4m3, block 64, ue8m0 scales. The rounding of the scale follows the reference
``kernel.py::act_quant`` as described by its ports: ``amax = max(amax, 1e-4)``,
``s = 2^ceil(log2(amax * fp32(1/448)))``, ``q = e4m3(clamp(x / s, -448, 448))``.

UE8M0 helpers live here because every format in this package uses the same exponent byte.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0
UE8M0_BIAS = 127
UE8M0_NAN = 255
DEFAULT_WEIGHT_BLOCK = (128, 128)
# The reference kernels multiply by an fp32 reciprocal instead of dividing; keep that rounding.
_INV_E4M3_MAX = torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32)
# act_quant floors the block amax so an all-zero block still gets a finite scale.
_ACT_AMAX_FLOOR = 1e-4

ScaleFormat = Literal["e8m0", "uint8", "float32"]
_SCALE_FORMATS = ("e8m0", "uint8", "float32")


# --- UE8M0 (power-of-two scale: one unsigned exponent byte, bias 127, 255 = NaN) ---------------


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scale tensor -> float32 multipliers.

    ``float8_e8m0fnu`` and ``uint8`` hold exponent bytes b: value 2^(b - 127); 0 -> 2^-127,
    127 -> 1.0, 254 -> 2^127, 255 -> NaN. Any other floating dtype is taken as the multiplier
    itself (HF float32 ``weight_scale_inv``). The bytes are turned into float32 bit patterns, so
    the result is exact on every device (no exp2/ldexp rounding).
    """
    if scale.dtype == torch.float8_e8m0fnu:
        b = scale.view(torch.uint8)
    elif scale.dtype == torch.uint8:
        b = scale
    elif scale.dtype.is_floating_point:
        return scale.float()
    else:
        raise TypeError(f"unsupported scale dtype {scale.dtype}")
    b32 = b.to(torch.int32)
    bits = torch.where(b32 == 0, 1 << 22, b32 << 23)  # 2^-127 is an fp32 subnormal
    bits = torch.where(b32 == UE8M0_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32)


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) as int32 for finite x > 0 (float32 log2 misrounds near powers of two)."""
    mant, exp = torch.frexp(x.float())  # x = mant * 2^exp, mant in [0.5, 1)
    return (exp - (mant == 0.5).to(exp.dtype)).to(torch.int32)


def encode_ue8m0(exponent: torch.Tensor, scale_format: ScaleFormat = "e8m0") -> torch.Tensor:
    """Integer exponents e (2^e, e in [-127, 127]; 128 means NaN) -> scale tensor in ``scale_format``."""
    if scale_format not in _SCALE_FORMATS:
        raise ValueError(f"scale_format must be one of {_SCALE_FORMATS}, got {scale_format!r}")
    b = (exponent.to(torch.int32) + UE8M0_BIAS).clamp(0, UE8M0_NAN).to(torch.uint8)
    if scale_format == "uint8":
        return b
    if scale_format == "e8m0":
        return b.view(torch.float8_e8m0fnu)
    return ue8m0_to_float(b)


def ue8m0_exponent_for(amax: torch.Tensor, inv_max: torch.Tensor) -> torch.Tensor:
    """Smallest e with amax * inv_max <= 2^e, i.e. the ue8m0 scale that avoids clipping."""
    return ceil_log2(amax * inv_max.to(amax.device))


def exp2_exact(exponent: torch.Tensor) -> torch.Tensor:
    """2^e as float32, exact (via the same byte path as decoding); 128 -> NaN."""
    return ue8m0_to_float(encode_ue8m0(exponent, "uint8"))


# --- E4M3 -------------------------------------------------------------------------------------


def e4m3_to_float(x: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn`` (or its raw bytes as uint8) -> float32. 0x7F/0xFF are NaN; no infinities."""
    if x.dtype == torch.uint8:
        x = x.view(torch.float8_e4m3fn)
    if x.dtype != torch.float8_e4m3fn:
        raise TypeError(f"expected float8_e4m3fn or uint8 bytes, got {x.dtype}")
    return x.float()


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    # Clamp first: the cast saturates on CPU but we do not rely on that on every backend.
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def check_finite(x: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what} holds NaN or infinity; it cannot be quantized")


# --- 2D block weights -------------------------------------------------------------------------


def _scale_grid(shape: torch.Size, block: tuple[int, int]) -> tuple[int, int]:
    bn, bk = block
    return (-(-shape[-2] // bn), -(-shape[-1] // bk))


def dequantize_fp8_block(
    weight_e4m3: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = DEFAULT_WEIGHT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """w[n, k] = e4m3[n, k] * scale[n // bn, k // bk].

    ``weight_e4m3``: [..., N, K] ``float8_e4m3fn`` (or uint8 bytes). ``scale``: [..., ceil(N/bn),
    ceil(K/bk)] as ``float8_e8m0fnu``/uint8 exponent bytes or float multipliers. N and K need not be
    multiples of the block: the last row/column of blocks is partial. NaN bytes (weight 0x7F/0xFF,
    scale 255) decode to NaN and propagate. The product is exact in float32, so bf16 output is the
    correctly rounded value.
    """
    if weight_e4m3.ndim < 2:
        raise ValueError(f"weight must be at least 2-D, got shape {tuple(weight_e4m3.shape)}")
    grid = _scale_grid(weight_e4m3.shape, block)
    if scale.shape[-2:] != grid or scale.shape[:-2] != weight_e4m3.shape[:-2]:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match weight {tuple(weight_e4m3.shape)} "
            f"with block {tuple(block)} (expected {(*weight_e4m3.shape[:-2], *grid)})"
        )
    n, k = weight_e4m3.shape[-2:]
    w = e4m3_to_float(weight_e4m3)
    s = ue8m0_to_float(scale).to(w.device)
    s = s.repeat_interleave(block[0], dim=-2)[..., :n, :]
    s = s.repeat_interleave(block[1], dim=-1)[..., :k]
    return (w * s).to(dtype)


def quantize_fp8_block(
    w: torch.Tensor,
    block: tuple[int, int] = DEFAULT_WEIGHT_BLOCK,
    scale_format: ScaleFormat = "e8m0",
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float weight -> (e4m3 [..., N, K], ue8m0 scale [..., ceil(N/bn), ceil(K/bk)]).

    Per block: s = 2^ceil(log2(amax * fp32(1/448))), the smallest power of two that needs no
    clipping (the same rounding as HF's ue8m0 quantizer and the reference act_quant); an all-zero
    block gets s = 1. Exponents are clamped to the ue8m0 range [-127, 127]. Values already on a
    block's e4m3 * 2^e grid come back exactly. Non-finite input is rejected.
    """
    if w.ndim < 2:
        raise ValueError(f"weight must be at least 2-D, got shape {tuple(w.shape)}")
    check_finite(w, "weight")
    bn, bk = block
    n, k = w.shape[-2:]
    gn, gk = _scale_grid(w.shape, block)
    wf = F.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n))  # zeros do not change a block's amax
    blocks = wf.unflatten(-1, (gk, bk)).unflatten(-3, (gn, bn))  # [..., gn, bn, gk, bk]
    amax = blocks.abs().amax(dim=(-3, -1))
    # Floor amax where 2^-127 takes over, so subnormal amax cannot underflow the product to 0.
    floored = amax.clamp_min(FP8_E4M3_MAX * 2.0**-UE8M0_BIAS)
    exponent = ue8m0_exponent_for(floored, _INV_E4M3_MAX).clamp(-UE8M0_BIAS, UE8M0_BIAS)
    exponent = torch.where(amax == 0, 0, exponent)
    s = exp2_exact(exponent)[..., :, None, :, None]
    q = _to_e4m3(blocks / s).flatten(-2).flatten(-3, -2)[..., :n, :k].contiguous()
    return q, encode_ue8m0(exponent, scale_format)


# --- 1D block activations (QAT simulation, FP8 KV cache) --------------------------------------


def quantize_fp8_ue8m0(
    x: torch.Tensor, block: int = 64, scale_format: ScaleFormat = "e8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dim in blocks: (e4m3 [..., K], ue8m0 scale [..., K // block]).

    Reference ``act_quant`` rounding: amax floored at 1e-4, s = 2^ceil(log2(amax * fp32(1/448))).
    K must be a multiple of ``block``. A block holding NaN or infinity gets scale byte 255 (NaN),
    so the whole block decodes to NaN: a corrupted activation is never silently zeroed.
    """
    kdim = x.shape[-1]
    if kdim % block:
        raise ValueError(f"last dim {kdim} is not a multiple of block {block}")
    xf = x.float().unflatten(-1, (kdim // block, block))
    amax = xf.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(amax)
    exponent = ue8m0_exponent_for(amax.clamp_min(_ACT_AMAX_FLOOR), _INV_E4M3_MAX)
    exponent = torch.where(finite, exponent, UE8M0_NAN - UE8M0_BIAS)
    q = _to_e4m3(xf / exp2_exact(exponent)).flatten(-2)
    return q, encode_ue8m0(exponent.squeeze(-1), scale_format)


def dequantize_fp8_ue8m0(
    q: torch.Tensor, scale: torch.Tensor, block: int = 64, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_ue8m0`: e4m3 [..., K] * scale [..., K // block]."""
    kdim = q.shape[-1]
    if kdim % block or scale.shape != (*q.shape[:-1], kdim // block):
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match {tuple(q.shape)} with block {block}"
        )
    vals = e4m3_to_float(q).unflatten(-1, (kdim // block, block))
    return (vals * ue8m0_to_float(scale).unsqueeze(-1)).flatten(-2).to(dtype)


def fake_quant_fp8_ue8m0(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Quantize-dequantize along the last dim (the reference's QAT simulation); returns x's dtype."""
    q, s = quantize_fp8_ue8m0(x, block, "uint8")
    return dequantize_fp8_ue8m0(q, s, block, x.dtype)
