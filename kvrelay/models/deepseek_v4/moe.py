"""DeepSeek-V4 MoE: sqrt-softplus router (bias-corrected top-k, or hash routing through
`tid2eid`), routed scaling, clamped SwiGLU experts and one shared expert."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.layers.parallel import SINGLE
from kvrelay.models.deepseek_v4.config import DeepseekV4Config
from kvrelay.models.deepseek_v4.experts import clamped_swiglu, make_experts
from kvrelay.models.deepseek_v4.fused_projections import project_all
from kvrelay.models.deepseek_v4.fusion import fusable
from kvrelay.models.deepseek_v4.precision import wide, wide_dtype, wide_weight


@fusable
def route(
    logits: torch.Tensor,
    hashed: torch.Tensor | None,
    bias: torch.Tensor | None,
    top_k: int,
    scoring_func: str,
    norm_topk_prob: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate logits [n, E] -> (weights [n, k] wide, expert indices [n, k]): the hash table's
    experts (`hashed`), or the top-k of the bias-corrected scores."""
    if scoring_func == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = logits.softmax(dim=-1)
    if hashed is not None:
        idx = hashed
    else:
        idx = (scores + bias.to(scores.dtype)).topk(top_k, dim=-1).indices
    weights = scores.gather(1, idx)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scale, idx


@fusable
def swiglu_down_input(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The shared expert's activation, computed wide and returned in the model dtype."""
    return clamped_swiglu(wide(gate), wide(up), limit).to(gate.dtype)


@fusable
def add_wide(routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """routed (wide) + shared, summed wide and returned in the shared output's dtype."""
    return (routed + wide(shared)).to(shared.dtype)


class Router(nn.Module):
    def __init__(
        self, config: DeepseekV4Config, hash_routed: bool, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        c = config
        self.hash_routed, self.top_k = hash_routed, c.num_experts_per_tok
        self.scoring_func, self.norm_topk_prob = c.scoring_func, c.norm_topk_prob
        self.routed_scaling_factor = c.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(c.n_routed_experts, c.hidden_size, dtype=dtype))
        if hash_routed:
            self.register_buffer("tid2eid", torch.zeros(c.vocab_size, self.top_k, dtype=torch.long))
        else:  # corrects selection only, never the weights (noaux_tc)
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(c.n_routed_experts, dtype=wide_dtype(dtype))
            )

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [n, hidden] -> (weights [n, k] wide, expert indices [n, k])."""
        xw = wide(x)
        logits = F.linear(xw, wide_weight(self.weight))  # the gate runs in fp32
        hashed = self.tid2eid[input_ids].long() if self.hash_routed else None
        bias = None if self.hash_routed else self.e_score_correction_bias
        return route(
            logits, hashed, bias, self.top_k, self.scoring_func, self.norm_topk_prob,
            self.routed_scaling_factor,
        )  # fmt: skip


class SharedExpert(nn.Module):
    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        h, i = config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
        self.limit = config.swiglu_limit
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype)
        self.fused_gate_up: torch.Tensor | None = None  # both in one (fused_projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project_all(x, self.fused_gate_up, self.gate_proj, self.up_proj)
        return self.down_proj(swiglu_down_input(gate, up, self.limit))


class MoE(nn.Module):
    def __init__(
        self, config: DeepseekV4Config, hash_routed: bool, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.gate = Router(config, hash_routed, dtype)
        self.experts = make_experts(config, dtype)
        self.shared_experts = SharedExpert(config, dtype)
        # Tensor parallel (weights/dsv4_tp.py): the shared expert is column/row split; routed
        # experts are split by intermediate dim, or with expert parallel this rank holds the
        # experts first..first+count-1. Either way the output is a partial sum over ranks.
        self.tp = SINGLE
        self.local_experts: tuple[int, int] | None = None  # (first, count) under EP
        self.all_to_all = False  # EP: each rank's tokens go to their experts' ranks and back

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, experts_fn: Callable | None = None
    ) -> torch.Tensor:
        """`experts_fn(x, weights, idx, experts)`, if given, computes the routed experts (the
        fused kernel: no host sync); else their torch forward."""
        if self.all_to_all:
            return self._forward_all_to_all(x, input_ids, experts_fn)
        weights, idx = self.gate(x, input_ids)  # every rank routes identically
        if self.local_experts is not None:
            idx = local_expert_ids(idx, *self.local_experts)
        if experts_fn is not None:
            routed = experts_fn(x, weights, idx, self.experts)
        else:
            routed = self.experts(x, weights, idx)
        shared = self.shared_experts(x)
        if not self.tp.is_parallel:
            return add_wide(routed, shared)
        # One all-reduce of routed + shared partial sums, wide like add_wide, then the dtype.
        # gloo sums in a fixed order, so every rank gets the same bits (not TP=1's: another
        # association of the same float32 terms).
        return self.tp.all_reduce(routed + wide(shared)).to(shared.dtype)

    def _forward_all_to_all(
        self, x: torch.Tensor, input_ids: torch.Tensor, experts_fn: Callable | None
    ) -> torch.Tensor:
        """`--ep-dispatch all-to-all` (ep_dispatch.py): this rank routes the rows it owns, sends
        them to their experts' ranks and back, adds its whole shared expert, all-gathers."""
        from kvrelay.models.deepseek_v4 import ep_dispatch as ep

        lo, hi = ep.own_rows(x.shape[0], self.tp)
        mine = x[lo:hi]
        weights, idx = self.gate(mine, input_ids[lo:hi])

        def compute(xr: torch.Tensor, wr: torch.Tensor, ir: torch.Tensor) -> torch.Tensor:
            if experts_fn is not None:
                return experts_fn(xr, wr, ir, self.experts)
            return self.experts(xr, wr, ir)

        count = self.local_experts[1]
        routed = ep.dispatch_combine(mine, weights, idx, count, self.tp, compute)
        return ep.gather_rows(add_wide(routed, self.shared_experts(mine)), x.shape[0], self.tp)


def local_expert_ids(idx: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Global expert ids -> this rank's local ids, -1 for experts other ranks hold."""
    local = idx - first
    return torch.where((local >= 0) & (local < count), local, -1)
