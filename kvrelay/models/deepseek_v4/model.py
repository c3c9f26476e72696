"""DeepSeek-V4 model: embeddings, hyper-connection streams through the blocks, hyper head, final
norm and LM head, with the MTP block's weights. Parameter names are HF-transformers' names (the
MTP block, which HF does not load, sits at `model.mtp.0.*`).

`forward` runs a full sequence; `forward_incremental` runs the next chunk of a sequence given
its `SequenceState`. Both use the same per-layer code, so any chunking gives the same logits.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from kvrelay.layers.parallel import SINGLE, vocab_parallel_logits
from kvrelay.models.deepseek_v4.config import HASH_MOE, DeepseekV4Config
from kvrelay.models.deepseek_v4.layer import DecoderLayer
from kvrelay.models.deepseek_v4.mhc import HyperHead
from kvrelay.models.deepseek_v4.mtp import MTPLayer
from kvrelay.models.deepseek_v4.norms import RMSNorm
from kvrelay.models.deepseek_v4.state import SequenceState


class DeepseekV4Model(nn.Module):
    def __init__(
        self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32, with_mtp: bool = True
    ) -> None:
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(c, c.layer_types[i], c.mlp_layer_types[i] == HASH_MOE, dtype)
            for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.hc_head = HyperHead(c.hc_mult, c.hidden_size, c.hc_eps, c.rms_norm_eps, dtype)
        n_mtp = c.num_nextn_predict_layers if with_mtp else 0
        self.mtp = nn.ModuleList(MTPLayer(c, dtype) for _ in range(n_mtp))

    def new_state(self, device: torch.device | str = "cpu") -> SequenceState:
        return SequenceState(0, [layer.empty_state(device) for layer in self.layers])

    def forward(
        self, input_ids: torch.Tensor, state: SequenceState
    ) -> tuple[torch.Tensor, torch.Tensor, SequenceState]:
        """input_ids: [n], the next tokens of the sequence -> (final hidden [n, hidden],
        pre-head streams [n, hc, hidden] (the MTP block's input), new state)."""
        start = state.num_tokens
        x = self.embed_tokens(input_ids)
        streams = x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        layer_states = []
        for layer, layer_state in zip(self.layers, state.layers, strict=True):
            streams, layer_state = layer(streams, input_ids, start, layer_state)
            layer_states.append(layer_state)
        hidden = self.norm(self.hc_head(streams))
        return hidden, streams, SequenceState(start + input_ids.shape[0], layer_states)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(
        self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32, with_mtp: bool = True
    ) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV4Model(config, dtype, with_mtp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Tensor parallel (weights/dsv4_tp.py): the embedding and head hold this rank's
        # vocabulary rows; logits are all-gathered.
        self.tp = SINGLE

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] of final hidden states [n, hidden], in the model dtype."""
        if not self.tp.is_parallel:
            return self.lm_head(hidden)
        w = self.lm_head.weight
        return vocab_parallel_logits(hidden, w, self.config.vocab_size, self.tp).to(hidden.dtype)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def new_state(self) -> SequenceState:
        return self.model.new_state(self.device)

    def new_mtp_state(self, index: int = 0) -> SequenceState:
        return SequenceState(0, [self.model.mtp[index].empty_state(self.device)])

    @torch.no_grad()
    def forward_incremental(
        self, input_ids: torch.Tensor, state: SequenceState
    ) -> tuple[torch.Tensor, SequenceState]:
        """Logits [n, vocab] for the next n tokens of a sequence ([n] ids), and the new state."""
        hidden, _, state = self.model(input_ids, state)
        return self.compute_logits(hidden), state

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of full sequences: input_ids [T] -> [T, vocab], or [B, T] -> [B, T, vocab].

        positions, if given, must be 0..T-1 (a sequence that starts mid-way needs its state:
        use forward_incremental).
        """
        if input_ids.dim() == 2:
            return torch.stack([self.forward(row, positions) for row in input_ids])
        t = input_ids.shape[0]
        if positions is not None and not torch.equal(positions.reshape(-1).cpu(), torch.arange(t)):
            raise ValueError("full-sequence forward needs positions 0..T-1")
        return self.forward_incremental(input_ids, self.new_state())[0]

    @torch.no_grad()
    def forward_chunked(self, input_ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """Full-sequence logits computed chunk by chunk through the incremental state."""
        state, out = self.new_state(), []
        for b in range(0, input_ids.shape[0], chunk_size):
            logits, state = self.forward_incremental(input_ids[b : b + chunk_size], state)
            out.append(logits)
        return torch.cat(out)

    @torch.no_grad()
    def forward_with_mtp(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full sequence [T] -> (logits [T, vocab], MTP logits [T-1, vocab]); MTP row t predicts
        token t+2 from the streams at t and token t+1."""
        hidden, streams, _ = self.model(input_ids, self.new_state())
        mtp_hidden, _ = self.model.mtp[0].predict(
            streams[:-1],
            self.model.embed_tokens(input_ids[1:]),
            input_ids[1:],
            0,
            self.new_mtp_state().layers[0],
        )
        return self.compute_logits(hidden), self.compute_logits(mtp_hidden)

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load HF-named weights strictly, except that an absent MTP block is allowed (HF
        checkpoints do not carry it) and stays as initialised."""
        own = self.state_dict()
        missing = set(own) - set(state_dict)
        if missing and all(k.startswith("model.mtp.") for k in missing):
            if missing != {k for k in own if k.startswith("model.mtp.")}:
                raise KeyError(f"partial MTP block in checkpoint: missing {sorted(missing)[:5]}")
            merged = dict(own)
            merged.update(state_dict)
            state_dict = merged
        self.load_state_dict(state_dict, strict=True)
