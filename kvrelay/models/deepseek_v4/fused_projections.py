"""Projections that read the same input, computed by one GEMM on the fast path: the attention's
q_a and K = V projections, and the shared expert's gate and up. Their weights become row blocks
of one tensor (each nn.Linear keeps a view, so names, loading and the reference path are
unchanged); a decode step then launches one GEMM where it launched two."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def share_rows(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate the linears' weights into one tensor and make each weight a view of its
    rows; returns the tensor (x @ it.T is every projection side by side)."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[row : row + n], requires_grad=False)
        row += n
    return fused


def project_all(x: torch.Tensor, fused: torch.Tensor | None, *linears: nn.Linear):
    """Each linear applied to x: one GEMM over `fused` (`share_rows` of them), or one each."""
    if fused is None:
        return tuple(lin(x) for lin in linears)
    return F.linear(x, fused).split([lin.weight.shape[0] for lin in linears], dim=-1)


def fuse_projections(model: nn.Module) -> int:
    """Share rows for every DeepSeek-V4 layer whose projections are plain nn.Linear (FP8 ones
    stay separate); returns how many pairs were fused."""
    fused = 0
    for layer in model.model.layers:
        attn, shared = layer.self_attn, layer.mlp.shared_experts
        if type(attn.q_a_proj) is nn.Linear and type(attn.kv_proj) is nn.Linear:
            attn.fused_in = share_rows(attn.q_a_proj, attn.kv_proj)
            fused += 1
        if type(shared.gate_proj) is nn.Linear and type(shared.up_proj) is nn.Linear:
            shared.fused_gate_up = share_rows(shared.gate_proj, shared.up_proj)
            fused += 1
    return fused
