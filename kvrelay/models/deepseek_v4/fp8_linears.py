"""FP8 block-scaled weights for DeepSeek-V4's attention and shared-expert projections (the
`--linear-weights fp8` option): e4m3 with one power-of-two scale per 128 x 128 block, the format
DeepSeek ships these weights in, read by `kernels.triton_fp8_linear` on the GPU (half the bytes
of bf16 per decode step) and by its dequantizing torch reference elsewhere.

Requantizing a dequantized DeepSeek FP8 checkpoint gives its original bytes back (same blocks,
same scale rule); bf16 weights (dummy, or converted checkpoints) are rounded to FP8 once here.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrelay.kernels.triton_fp8_linear import fp8_linear, fp8_linear_reference
from kvrelay.models.deepseek_v4.attention import GroupedLinear
from kvrelay.quant.fp8_block import quantize_fp8_block, ue8m0_to_float


class Fp8Linear(nn.Module):
    """A bias-free linear (or the grouped output projection, `groups` > 1) with FP8 weights."""

    def __init__(self, weight: torch.Tensor, groups: int = 1) -> None:
        super().__init__()
        q, scale = quantize_fp8_block(weight.detach())
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", ue8m0_to_float(scale).to(weight.device))
        self.groups = groups
        self.model_dtype = weight.dtype  # what the activations stay in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype != torch.float64:
            return fp8_linear(x, self.weight, self.weight_scale, self.groups)
        return fp8_linear_reference(x, self.weight, self.weight_scale, self.groups)


def use_fp8_linears(model: nn.Module) -> int:
    """Swap the attention projections and the shared experts' linears of every DeepSeek-V4
    layer for FP8 ones (the weights are quantized once, the bf16 copies dropped); returns how
    many were swapped. The compressors, indexer and router stay wide (the reference runs
    them in fp32)."""
    swapped = 0
    for layer in model.model.layers:
        attn, shared = layer.self_attn, layer.mlp.shared_experts
        for owner, names in (
            (attn, ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "o_a_proj")),
            (shared, ("gate_proj", "up_proj", "down_proj")),
        ):
            for name in names:
                old = getattr(owner, name)
                groups = old.groups if isinstance(old, GroupedLinear) else 1
                setattr(owner, name, Fp8Linear(old.weight, groups))
                swapped += 1
    return swapped
