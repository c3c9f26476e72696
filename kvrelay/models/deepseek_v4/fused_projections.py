"""Projections that read the same input, computed by one GEMM on the fast path: the attention's
q_a and K = V projections, and the shared expert's gate and up. Their weights become row blocks
of one tensor (each nn.Linear keeps a view, so names, loading and the reference path are
unchanged); a decode step then launches one GEMM where it launched two.

The projections the reference runs in fp32 from the attention input (the compressor's K/V and
gate, the indexer's, and the indexer's head weights: five GEMMs of a CSA layer) get one fp32
GEMM the same way (`WideRows`: a wide copy side by side, made again when a weight changes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.models.deepseek_v4.precision import wide, wide_dtype, wide_weight


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


class WideRows:
    """The wide-dtype copy of several linears' weights side by side (x @ it.T: each projection
    in fp32, as `wide_weight` gives them one by one), made again when one of them changes in
    place (a load), as `wide_weight` does for one weight."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.sizes = [lin.weight.shape[0] for lin in linears]
        self._key: tuple | None = None
        self._weight: torch.Tensor | None = None

    def weight(self) -> torch.Tensor:
        ws = [lin.weight for lin in self.linears]
        key = tuple((w.data_ptr(), w._version) for w in ws)
        if key != self._key:
            self._weight = torch.cat([w.detach().to(wide_dtype(w.dtype)) for w in ws])
            self._key = key
        return self._weight


def project_wide(x: torch.Tensor, fused: WideRows | None, *linears: nn.Linear):
    """Each linear applied to x in the wide dtype: one GEMM over `fused`, or one each."""
    xw = wide(x)
    if fused is None:
        return tuple(F.linear(xw, wide_weight(lin.weight)) for lin in linears)
    return F.linear(xw, fused.weight()).split(fused.sizes, dim=-1)


def fuse_projections(model: nn.Module) -> int:
    """Share rows for every DeepSeek-V4 layer whose projections are plain nn.Linear (FP8 ones
    stay separate), and the wide projections of its attention input; returns how many groups
    were fused."""
    fused = 0
    for layer in model.model.layers:
        attn, shared = layer.self_attn, layer.mlp.shared_experts
        if type(attn.q_a_proj) is nn.Linear and type(attn.kv_proj) is nn.Linear:
            attn.fused_in = share_rows(attn.q_a_proj, attn.kv_proj)
            fused += 1
        if type(shared.gate_proj) is nn.Linear and type(shared.up_proj) is nn.Linear:
            shared.fused_gate_up = share_rows(shared.gate_proj, shared.up_proj)
            fused += 1
        if attn.compressor is not None:
            attn.fused_wide = WideRows(*attn.wide_linears())
            fused += 1
    return fused
