"""One DeepSeek-V4 block: attention and MoE, each wrapped by its own hyper-connection."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvrelay.layers.step_profile import ATTENTION, MOE, StepProfiler, timed
from kvrelay.models.deepseek_v4.attention import Attention
from kvrelay.models.deepseek_v4.config import DeepseekV4Config
from kvrelay.models.deepseek_v4.mhc import HyperConnection, Pending
from kvrelay.models.deepseek_v4.moe import MoE
from kvrelay.models.deepseek_v4.norms import RMSNorm
from kvrelay.models.deepseek_v4.state import LayerState


@dataclass(frozen=True)
class LayerKernels:
    """Fused replacements for torch ops of a block (None: the torch reference):
    experts(x, weights, idx, experts) -> routed output; hc_gates: see HyperConnection; hc_pre: a
    hyper-connection's pre side with the merge before it and the norm after it
    (`HyperConnection.pre_fused`, `run_fused`) for steps of at most `hc_pre_max_tokens`."""

    experts: Callable | None = None
    hc_gates: Callable | None = None
    hc_pre: Callable | None = None
    hc_pre_max_tokens: int = 0
    fuse_glue: bool = True  # the glue between kernels compiled (fusion.py); False: eager


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: DeepseekV4Config,
        layer_type: str,
        hash_routed: bool,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        c = config
        self.self_attn = Attention(c, layer_type, dtype)
        self.mlp = MoE(c, hash_routed, dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        hc = (c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, dtype)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def empty_state(self, device: torch.device | str = "cpu") -> LayerState:
        return self.self_attn.empty_state(device)

    def forward(
        self, streams: torch.Tensor, input_ids: torch.Tensor, start: int, state: LayerState
    ) -> tuple[torch.Tensor, LayerState]:
        """streams: [n, hc_mult, hidden] of tokens start..start+n-1 -> (streams, state)."""
        new_state: list[LayerState] = []

        def attend(x: torch.Tensor) -> torch.Tensor:
            out, s = self.self_attn(x, start, state)
            new_state.append(s)
            return out

        return self.run(streams, input_ids, attend), new_state[0]

    def run(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        attend: Callable[[torch.Tensor], torch.Tensor],
        profile: StepProfiler | None = None,
        kernels: LayerKernels | None = None,
    ) -> torch.Tensor:
        """The block around an attention callback: `attend` maps the normed inputs of all rows
        to their attention outputs (one sequence here; a batch of them in the paged engine).
        `profile` (a profiled engine step) times attention and MoE; `kernels` replace torch ops
        with fused kernels (the fast path)."""
        k = kernels or LayerKernels()
        h, post, comb = self.attn_hc(streams, k.hc_gates)
        h = self.input_layernorm(h)
        with timed(profile, ATTENTION):
            h = attend(h)
        streams = HyperConnection.merge(h, streams, post, comb)
        h, post, comb = self.ffn_hc(streams, k.hc_gates)
        h = self.post_attention_layernorm(h)
        with timed(profile, MOE):
            out = self.mlp(h, input_ids, k.experts)
        return HyperConnection.merge(out, streams, post, comb)

    def run_fused(
        self,
        streams: torch.Tensor,
        pending: Pending | None,
        input_ids: torch.Tensor,
        attend: Callable[[torch.Tensor], torch.Tensor],
        profile: StepProfiler | None,
        kernels: LayerKernels,
    ) -> tuple[torch.Tensor, Pending]:
        """`run` with `kernels.hc_pre`: each sub-layer's merge is left pending and done by the
        next sub-layer's pre kernel (the next block's, across blocks), so the mHC of a sub-layer
        is two launches. `pending` (out, post, comb) applies to `streams`; returns the streams
        and this block's pending FFN merge (`HyperConnection.merge(out, streams, post, comb)`
        finishes the last block)."""
        pre = kernels.hc_pre
        streams, h, post, comb = self.attn_hc.pre_fused(pre, streams, pending, self.input_layernorm)
        with timed(profile, ATTENTION):
            h = attend(h)
        streams, h, post, comb = self.ffn_hc.pre_fused(
            pre, streams, (h, post, comb), self.post_attention_layernorm
        )
        with timed(profile, MOE):
            out = self.mlp(h, input_ids, kernels.experts)
        return streams, (out, post, comb)
