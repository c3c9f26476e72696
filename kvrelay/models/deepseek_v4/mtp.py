"""The multi-token-prediction (MTP) block: a sliding-window, bias-routed block fed with the main
model's last streams at t and the embedding of token t+1; its logits predict token t+2."""

from __future__ import annotations

import torch
from torch import nn

from kvrelay.models.deepseek_v4.config import SLIDING, DeepseekV4Config
from kvrelay.models.deepseek_v4.layer import DecoderLayer
from kvrelay.models.deepseek_v4.mhc import HyperHead
from kvrelay.models.deepseek_v4.norms import RMSNorm
from kvrelay.models.deepseek_v4.state import LayerState


class MTPLayer(DecoderLayer):
    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32) -> None:
        if config.mtp_expert_format is not None:
            config = config.with_(expert_format=config.mtp_expert_format)
        super().__init__(config, SLIDING, hash_routed=False, dtype=dtype)
        c = config
        h = c.hidden_size
        self.enorm = RMSNorm(h, c.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, c.rms_norm_eps, dtype)
        self.e_proj = nn.Linear(h, h, bias=False, dtype=dtype)
        self.h_proj = nn.Linear(h, h, bias=False, dtype=dtype)
        self.norm = RMSNorm(h, c.rms_norm_eps, dtype)
        self.hc_head = HyperHead(c.hc_mult, h, c.hc_eps, c.rms_norm_eps, dtype)

    def predict(
        self,
        streams: torch.Tensor,
        next_embeds: torch.Tensor,
        input_ids: torch.Tensor,
        start: int,
        state: LayerState,
    ) -> tuple[torch.Tensor, LayerState]:
        """streams: [n, hc, hidden] main-model streams at t; next_embeds: [n, hidden] embeddings
        of tokens t+1 -> (final hidden state [n, hidden] for the shared head, state)."""
        x = self.e_proj(self.enorm(next_embeds))[:, None, :] + self.h_proj(self.hnorm(streams))
        x, state = self(x, input_ids, start, state)
        return self.norm(self.hc_head(x)), state
