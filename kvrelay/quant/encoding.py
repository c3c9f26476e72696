"""How one stored weight is encoded (`Quant`: its format and the names of its companion
tensors) and the dense tensor it stands for (`dequantize`): what checkpoint readers and lazy
tensor sources share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.quant.fp8_block import DEFAULT_WEIGHT_BLOCK, dequantize_fp8_block
from kvrelay.quant.mxfp4 import dequantize_mxfp4
from kvrelay.quant.nvfp4 import dequantize_nvfp4


@dataclass(frozen=True)
class Quant:
    """How one stored weight is encoded: fmt in none | fp8_block | mxfp4 | nvfp4, and the names
    of its companion tensors by role (scale; or weight_scale, weight_scale_2, input_scale)."""

    fmt: str
    companions: dict[str, str]


def dequantize(
    weight: torch.Tensor,
    quant: Quant,
    parts: dict[str, torch.Tensor],
    dtype: torch.dtype,
    block: tuple[int, int] = DEFAULT_WEIGHT_BLOCK,
) -> torch.Tensor:
    """A stored weight and its companion tensors (by role) -> the dense tensor in `dtype`
    (unquantized weights come back as stored)."""
    if quant.fmt == "none":
        return weight
    if quant.fmt == "fp8_block":
        return dequantize_fp8_block(weight, parts["scale"], block, dtype)
    if quant.fmt == "mxfp4":
        return dequantize_mxfp4(weight, parts["scale"], dtype)
    if quant.fmt == "nvfp4":
        return dequantize_nvfp4(weight, parts["weight_scale"], parts["weight_scale_2"], dtype)
    raise ValueError(f"unknown quantization {quant.fmt!r}")
