"""NVIDIA ModelOpt NVFP4 routed experts: packed e2m1 + e4m3 scale per 16 inputs + fp32 global scale.

Checkpoint facts (shared/reference/deepseek-v4.md §7, nvidia/DeepSeek-V4-Flash-NVFP4), per expert
``layers.N.ffn.experts.E.{w1,w2,w3}``:
- ``.weight``: U8, packed e2m1 [N, K/2] (w1/w3 [2048, 2048] for K = 4096; w2 [4096, 1024]);
- ``.weight_scale``: F8_E4M3 [N, K/16] (w1/w3 [2048, 256]; w2 [4096, 128]);
- ``.weight_scale_2``: F32 scalar (w1 and w3 have their own); ``.input_scale``: F32 scalar.
Only these routed experts are NVFP4; everything else (mtp.* experts too) is as in the native
checkpoint.

Dequantization (SGLang ``modelopt_quant.py`` l.780-797, quoted in §7):

    w[n, k] = e2m1(code[n, k]) * float32(weight_scale[n, k // 16]) * weight_scale_2

with element 2k in the low nibble of byte k. We multiply in that order in float32:
e2m1 * e4m3 is exact, so the only rounding is the final product with ``weight_scale_2``.
``input_scale`` plays no part here; the W4A4 path uses it (x is quantized as x / input_scale,
the GEMM output is scaled by alpha = input_scale * weight_scale_2).

The quantizer is for tests and tiny checkpoints, following the usual ModelOpt recipe:
weight_scale_2 = amax(w) / (6 * 448), weight_scale = e4m3(amax_block / (6 * weight_scale_2)),
code = e2m1(w / (weight_scale * weight_scale_2)).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvrelay.quant.fp4 import E2M1_MAX, decode_e2m1, encode_e2m1, pack_e2m1, unpack_e2m1
from kvrelay.quant.fp8_block import FP8_E4M3_MAX, check_finite, e4m3_to_float

NVFP4_BLOCK = 16


class NvFp4Weight(NamedTuple):
    """One NVFP4 matrix as the checkpoint holds it (suffixes: .weight, .weight_scale, ...)."""

    weight: torch.Tensor  # uint8 [..., N, K/2]
    weight_scale: torch.Tensor  # float8_e4m3fn [..., N, ceil(K/16)]
    weight_scale_2: torch.Tensor  # float32, shape [...] (a scalar for one matrix)
    input_scale: torch.Tensor  # float32, shape [...]; metadata for the W4A4 path


def _global_scale(
    weight_scale_2: torch.Tensor | float, lead: torch.Size, device: torch.device
) -> torch.Tensor:
    gs = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=device)
    if gs.shape not in ((), (1,), lead):
        raise ValueError(
            f"weight_scale_2 shape {tuple(gs.shape)} is neither scalar nor {tuple(lead)}"
        )
    return gs.reshape(lead + (1, 1)) if gs.shape == lead and len(lead) else gs.reshape(())


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale_e4m3: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Packed [..., N, K/2] + e4m3 scales [..., N, ceil(K/16)] + global scale -> [..., N, K].

    ``block_scale_e4m3`` may be ``float8_e4m3fn`` or its raw uint8 bytes; ``weight_scale_2`` a
    scalar or one value per leading index (stacked experts). NaN scale bytes (0x7F/0xFF) give NaN.
    """
    if packed.ndim < 2:
        raise ValueError(f"packed weight must be at least 2-D, got shape {tuple(packed.shape)}")
    vals = decode_e2m1(unpack_e2m1(packed))
    kdim = vals.shape[-1]
    expected = (*vals.shape[:-1], -(-kdim // NVFP4_BLOCK))
    if tuple(block_scale_e4m3.shape) != expected:
        raise ValueError(
            f"weight_scale shape {tuple(block_scale_e4m3.shape)} does not match packed "
            f"{tuple(packed.shape)} (expected {expected})"
        )
    bs = e4m3_to_float(block_scale_e4m3).to(vals.device)
    bs = bs.repeat_interleave(NVFP4_BLOCK, dim=-1)[..., :kdim]
    gs = _global_scale(weight_scale_2, vals.shape[:-2], vals.device)
    return ((vals * bs) * gs).to(dtype)


def quantize_nvfp4(
    w: torch.Tensor,
    weight_scale_2: torch.Tensor | float | None = None,
    input_scale: torch.Tensor | float = 1.0,
) -> NvFp4Weight:
    """[..., N, K] float weight (K even) -> :class:`NvFp4Weight`.

    ``weight_scale_2`` defaults to amax / (6 * 448) per matrix (1.0 for an all-zero matrix); pass
    it to pin the global scale. A block whose e4m3 scale rounds to 0 encodes as zeros. Values
    that are e2m1 * weight_scale * weight_scale_2 with a +-6 code in every block, and a
    power-of-two ``weight_scale_2``, come back bit-exactly. Non-finite input is rejected.
    """
    if w.ndim < 2 or w.shape[-1] % 2:
        raise ValueError(f"weight must be at least 2-D with an even last dim, got {tuple(w.shape)}")
    check_finite(w, "weight")
    lead = w.shape[:-2]
    kdim = w.shape[-1]
    wf = w.float()
    if weight_scale_2 is None:
        amax = wf.abs().amax(dim=(-2, -1)) if wf.numel() else wf.new_zeros(lead)
        gs_lead = torch.where(amax > 0, amax / (E2M1_MAX * FP8_E4M3_MAX), 1.0)
    else:
        gs_lead = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=w.device)
        gs_lead = (
            gs_lead.reshape(()).expand(lead) if gs_lead.numel() == 1 else gs_lead.reshape(lead)
        )
        if not bool((gs_lead > 0).all()) or not bool(torch.isfinite(gs_lead).all()):
            raise ValueError("weight_scale_2 must be finite and positive")
    gs = gs_lead.reshape(lead + (1, 1, 1))
    nblocks = -(-kdim // NVFP4_BLOCK)
    blocks = F.pad(wf, (0, nblocks * NVFP4_BLOCK - kdim)).unflatten(-1, (nblocks, NVFP4_BLOCK))
    amax_b = blocks.abs().amax(dim=-1, keepdim=True)
    bs = (amax_b / (E2M1_MAX * gs)).clamp(0.0, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    step = bs.float() * gs
    scaled = torch.where(step > 0, blocks / step, 0.0)
    codes = encode_e2m1(scaled).flatten(-2)[..., :kdim]
    in_scale = torch.as_tensor(input_scale, dtype=torch.float32, device=w.device)
    return NvFp4Weight(
        weight=pack_e2m1(codes),
        weight_scale=bs.squeeze(-1),
        weight_scale_2=gs_lead.to(torch.float32).clone(),
        input_scale=in_scale.reshape(()).expand(lead).clone()
        if in_scale.numel() == 1
        else in_scale,
    )
