"""Random weights for any DeepSeek-V4 config (`--load-format dummy`, tests).

Scales keep activations O(1) through every block, so numerical comparisons between
implementations are sensitive to every term, not swamped by a few.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvrelay.models.deepseek_v4.experts import QuantizedExperts


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    on_gpu = next(model.parameters()).is_cuda
    # On the GPU, draw there: a DeepSeek-V4-sized model would take many minutes on the CPU.
    gd = torch.Generator(device="cuda").manual_seed(seed) if on_gpu else None

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        if gd is not None:
            t.normal_(mean, std, generator=gd)
            return
        t.copy_((torch.randn(t.shape, generator=g, dtype=torch.float64) * std + mean).to(t.dtype))

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            normal(p, 0.1, 1.0)
        elif leaf == "sinks":
            normal(p, 1.0)
        elif leaf == "position_bias":
            normal(p, 0.5)
        elif leaf in ("fn", "hc_fn"):
            normal(p, 1.0 / math.sqrt(p.shape[1]))
        elif leaf in ("base", "hc_base"):
            normal(p, 0.5)
        elif leaf in ("scale", "hc_scale"):
            normal(p, 0.1, 1.0)
        elif name.endswith("embed_tokens.weight"):
            normal(p, 1.0)
        else:  # projections, experts, router: fan-in scaling
            normal(p, 1.0 / math.sqrt(p.shape[-1]))
    for m in model.modules():
        if isinstance(m, QuantizedExperts):
            m.init_dummy(gd if gd is not None else g)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            normal(b, 0.1)
        elif name.endswith("tid2eid"):
            vocab, k = b.shape
            n_experts = _num_experts(model)
            # k distinct experts per token
            b.copy_(torch.rand(vocab, n_experts, generator=g).argsort(dim=-1)[:, :k])


def _num_experts(model: nn.Module) -> int:
    for name, p in model.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            return p.shape[0]
    for name, b in model.named_buffers():
        if name.endswith("experts.gate_up_packed"):
            return b.shape[0]
    raise ValueError("model has no routed experts")
