"""Dense Llama-family decoder: Llama, SmolLM2, Qwen2 (qkv bias), Qwen3 (qk-norm).

q/k/v and gate/up are fused into one projection each (fewer, larger GEMMs); the residual add is
fused into the next RMSNorm. Checkpoint names (HF) are mapped onto the fused weights on load.

Tensor parallel (`tp`, layers/parallel.py): each rank holds its q heads and its kv heads in
qkv_proj, its halves of gate and of up in gate_up_proj, the matching input slices of o_proj and
down_proj (all-reduced) and its rows of the vocabulary; `load_weights` cuts every full checkpoint
tensor to this rank's part. A world of 1 is the plain model.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrelay.config import ModelConfig
from kvrelay.layers import step_profile as prof
from kvrelay.layers.attention import AttentionBackend, AttentionMetadata
from kvrelay.layers.norm import RMSNorm
from kvrelay.layers.ops import TORCH_OPS, Ops
from kvrelay.layers.parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    vocab_parallel_logits,
    vocab_shard,
)


class ForwardContext:
    """Everything one forward pass needs besides the weights (no module-level state)."""

    def __init__(
        self,
        attn: AttentionMetadata,
        kv_caches,
        attn_backend: AttentionBackend,
        ops: Ops = TORCH_OPS,
        profile: prof.StepProfiler | None = None,
    ):
        self.attn, self.kv_caches, self.attn_backend, self.ops = attn, kv_caches, attn_backend, ops
        self.profile = profile  # set on a profiled (eager) step: times attention and MLP


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.layer, self.cfg = layer, cfg
        d = cfg.head_dim
        heads = tp.split(cfg.num_heads, "num_heads")
        kv_heads = tp.split(cfg.num_kv_heads, "num_kv_heads")
        self.q_size, self.kv_size = heads * d, kv_heads * d  # this rank's heads
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.scale = d**-0.5

    def forward(self, x, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        t, d, ops = x.shape[0], self.cfg.head_dim, ctx.ops
        qkv = self.qkv_proj(x)
        q = qkv[:, : self.q_size].view(t, -1, d)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, -1, d)
        v = qkv[:, self.q_size + self.kv_size :].view(t, -1, d)
        if self.cfg.qk_norm:
            q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)[0]
            k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)[0]
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
        k_cache, v_cache = ctx.kv_caches[self.layer]
        o = ctx.attn_backend.forward(q, k, v, k_cache, v_cache, ctx.attn, self.scale)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        inter = tp.split(cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * inter)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.down_proj(ctx.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, ctx: ForwardContext):
        """Returns (this layer's output, the residual stream before adding it)."""
        n1, n2, ops = self.input_layernorm, self.post_attention_layernorm, ctx.ops
        h, residual = ops.rms_norm(x, n1.weight, n1.eps, residual)
        with prof.timed(ctx.profile, prof.ATTENTION):
            h = self.self_attn(h, cos, sin, ctx)
        h, residual = ops.rms_norm(h, n2.weight, n2.eps, residual)
        with prof.timed(ctx.profile, prof.MLP):
            h = self.mlp(h, ctx)
        return h, residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# HF checkpoint name -> (fused parameter, shard index) for the fused projections.
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.model = Backbone(cfg, tp)
        self.rotary = None  # set by the loader once dtype and device are known
        if not cfg.tie_word_embeddings:  # this rank's vocabulary rows, like the embedding
            rows = self.model.embed_tokens.num_embeddings
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        """Returns the final-normed hidden states of every new token: [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        norm = self.model.norm
        return ctx.ops.rms_norm(x, norm.weight, norm.eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [T, V]; with TP every rank gets the full rows (all-gathered)."""
        w = self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return vocab_parallel_logits(hidden, w, self.cfg.vocab_size, self.tp)

    def _shard_sizes(self, fused: str) -> list[int]:
        """The sizes of the HF pieces inside a fused parameter (this rank's parts)."""
        c, w = self.cfg, self.tp.world
        if fused == "qkv_proj":
            return [
                c.num_heads // w * c.head_dim,
                c.num_kv_heads // w * c.head_dim,
                c.num_kv_heads // w * c.head_dim,
            ]
        return [c.intermediate_size // w, c.intermediate_size // w]

    def shard_range(self, name: str, shape) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's part of the full checkpoint tensor `name` (HF name)
        of `shape`; None: every rank keeps it whole. A reader can fetch just that slice."""
        tp = self.tp
        if not tp.is_parallel:
            return None
        owner = name.rpartition(".")[0].rpartition(".")[2]
        if owner in ("embed_tokens", "lm_head"):  # rows of the vocabulary, the last rank's short
            start, rows = vocab_shard(shape[0], tp)
            return 0, start, min(start + rows, shape[0])
        if owner in _PACKED:  # q/k/v by heads, gate/up by intermediate rows: output features
            dim = 0
        elif owner in ("o_proj", "down_proj"):  # row-parallel: input features
            dim = 1
        else:
            return None  # norms
        size = shape[dim]
        if size % tp.world:
            raise ValueError(
                f"{name}: dim {dim} of size {size} does not split over {tp.world} ranks"
            )
        part = size // tp.world
        return dim, tp.rank * part, (tp.rank + 1) * part

    def shard_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor `name` (HF name; a view if it can)."""
        r = self.shard_range(name, tensor.shape)
        return tensor if r is None else tensor.narrow(r[0], r[1], r[2] - r[1])

    def load_weights(self, weights, presharded: bool = False) -> None:
        """Load HF-named tensors, packing q/k/v and gate/up into their fused parameters. Full
        tensors are cut to this rank's part; `presharded`: the reader already did
        (`shard_range`)."""
        params = dict(self.named_parameters())
        expected = set()
        for name in params:
            mod, _, leaf = name.rpartition(".")
            owner = mod.rpartition(".")[2]
            packed = [k for k, (f, _) in _PACKED.items() if f == owner]
            if packed:
                expected |= {f"{mod.rpartition('.')[0]}.{k}.{leaf}" for k in packed}
            else:
                expected.add(name)
        seen = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if name not in expected:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if not presharded:
                tensor = self.shard_tensor(name, tensor)
            mod, _, leaf = name.rpartition(".")
            parent, _, owner = mod.rpartition(".")
            if owner in _PACKED:
                fused, idx = _PACKED[owner]
                sizes = self._shard_sizes(fused)
                target = params[f"{parent}.{fused}.{leaf}"].narrow(0, sum(sizes[:idx]), sizes[idx])
            else:
                target = params[name]
            if owner in ("embed_tokens", "lm_head") and len(tensor) < len(target):
                target = target[: len(tensor)]  # the vocabulary's tail: the rest is padding
                with torch.no_grad():
                    params[name][len(tensor) :].zero_()
            if target.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(tensor)
            seen.add(name)
        missing = expected - seen
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def split_fused(self, name: str, tensor: torch.Tensor):
        """(HF name, piece) of parameter `name` holding `tensor`: fused ones split back."""
        mod, _, leaf = name.rpartition(".")
        parent, _, owner = mod.rpartition(".")
        packed = [k for k, (f, _) in _PACKED.items() if f == owner]
        if not packed:
            return [(name, tensor)]
        pieces = tensor.split(self._shard_sizes(owner))
        return [(f"{parent}.{k}.{leaf}", piece) for k, piece in zip(packed, pieces, strict=True)]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under HF names (fused projections split back), e.g. to load into HF;
        with TP, this rank's parts."""
        out = {}
        for name, p in self.named_parameters():
            out.update(self.split_fused(name, p.detach()))
        return out
