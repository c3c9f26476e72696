"""DeepSeek-V4 attention: shared-KV MQA (K = V, one 512-d vector per token) over the sliding
window plus the layer's compressed entries (all visible ones for HCA, the indexer's top-k for
CSA), with per-head sinks, inverse RoPE on the output and the grouped output projection.

A call processes the next n tokens of one sequence given the state of the tokens before them,
so the full-sequence forward and every chunking of it run the same code.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrelay.layers.parallel import SINGLE
from kvrelay.models.deepseek_v4.compressor import QUANT_FP8, QUANT_NONE, Compressor
from kvrelay.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from kvrelay.models.deepseek_v4.fused_projections import project_all
from kvrelay.models.deepseek_v4.indexer import Indexer
from kvrelay.models.deepseek_v4.norms import HeadNorm, RMSNorm
from kvrelay.models.deepseek_v4.precision import wide_dtype
from kvrelay.models.deepseek_v4.qat import rope_round_fp8
from kvrelay.models.deepseek_v4.rope import RopeTable, apply_rope
from kvrelay.models.deepseek_v4.sparse_attention import sparse_attention
from kvrelay.models.deepseek_v4.state import LayerState


class GroupedLinear(nn.Module):
    """Block-diagonal projection: group g of the input uses rows g*rank..(g+1)*rank of weight."""

    def __init__(self, in_per_group: int, rank: int, groups: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.groups, self.rank = groups, rank
        self.weight = nn.Parameter(torch.zeros(groups * rank, in_per_group, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, groups, in_per_group] -> [n, groups, rank]."""
        w = self.weight.view(self.groups, self.rank, -1)
        return torch.einsum("ngi,gri->ngr", x, w)


class Attention(nn.Module):
    def __init__(
        self, config: DeepseekV4Config, layer_type: str, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        c = config
        self.layer_type = layer_type
        self.n_heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.rope_dim, self.nope_dim = c.qk_rope_head_dim, c.nope_head_dim
        self.window, self.qat = c.sliding_window, c.qat_simulation
        self.index_topk = c.index_topk
        self.o_groups = c.o_groups
        self.rope = RopeTable.for_layer(c, layer_type)

        h, hd = c.hidden_size, c.head_dim
        self.q_a_proj = nn.Linear(h, c.q_lora_rank, bias=False, dtype=dtype)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype)
        self.q_norm = HeadNorm(c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.n_heads * hd, bias=False, dtype=dtype)
        self.kv_proj = nn.Linear(h, hd, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(hd, c.rms_norm_eps, dtype)
        self.o_a_proj = GroupedLinear(
            self.n_heads * hd // c.o_groups, c.o_lora_rank, c.o_groups, dtype
        )
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, h, bias=False, dtype=dtype)
        self.fused_in: torch.Tensor | None = None  # q_a and kv rows in one (fused_projections)
        self.fused_wide = None  # the wide projections of the input in one (WideRows)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads, dtype=wide_dtype(dtype)))
        # Tensor parallel (weights/dsv4_tp.py): this rank's heads and output groups; the KV
        # head, compressors and q_a stay whole, o_b_proj's output is a partial sum.
        self.tp = SINGLE

        self.compressor: Compressor | None = None
        if layer_type != SLIDING:
            ratio = c.csa_compress_ratio if layer_type == CSA else c.hca_compress_ratio
            indexer = None
            if layer_type == CSA:
                indexer = Indexer(
                    h, c.q_lora_rank, c.index_n_heads, c.index_head_dim, ratio, self.rope,
                    c.qk_rope_head_dim, c.rms_norm_eps, c.qat_simulation, dtype,
                )  # fmt: skip
            self.compressor = Compressor(
                h, hd, ratio, layer_type == CSA, self.rope, c.qk_rope_head_dim, c.rms_norm_eps,
                QUANT_FP8 if c.qat_simulation else QUANT_NONE, dtype, indexer,
            )  # fmt: skip

    @property
    def indexer(self) -> Indexer | None:
        return getattr(self.compressor, "indexer", None)

    def wide_linears(self) -> list[nn.Linear]:
        """The projections of the input the reference runs in fp32: the compressor's K/V and
        gate, then the indexer's and its head weights (CSA)."""
        c, ix = self.compressor, self.indexer
        extra = [] if ix is None else [ix.kv_proj, ix.gate_proj, ix.scorer.weights_proj]
        return [] if c is None else [c.kv_proj, c.gate_proj, *extra]

    def empty_state(self, device: torch.device | str = "cpu") -> LayerState:
        # the model dtype (an FP8 projection remembers the one it replaced)
        dtype = getattr(self.kv_proj, "model_dtype", self.kv_proj.weight.dtype)
        return LayerState(
            window=torch.empty(0, self.head_dim, dtype=dtype, device=device),
            compressor=None if self.compressor is None else self.compressor.empty_state(device),
            indexer=None if self.indexer is None else self.indexer.empty_state(device),
        )

    def forward(
        self, x: torch.Tensor, start: int, state: LayerState
    ) -> tuple[torch.Tensor, LayerState]:
        """x: [n, hidden], the normed inputs of tokens start..start+n-1 -> ([n, hidden], state)."""
        n, hd = x.shape[0], self.head_dim
        positions = torch.arange(start, start + n, device=x.device)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        qr, q, kv = self.project(x, cos, sin)

        # Window part: local buffer = the last w cached tokens followed by the new ones.
        past = state.window
        w = past.shape[0]
        keys = torch.cat((past, kv))
        offs = torch.arange(self.window, device=x.device) - (self.window - 1)
        win_idx = (torch.arange(n, device=x.device) + w)[:, None] + offs[None, :]
        win_idx = win_idx.masked_fill(win_idx < 0, -1)
        keep = min(self.window - 1, keys.shape[0])
        new_state = LayerState(window=keys[keys.shape[0] - keep :], new_kv=kv)

        if self.compressor is None:
            buf, indices = keys, win_idx
        else:
            _, cstate = self.compressor(x, start, state.compressor)
            new_state.compressor = cstate
            entries = cstate.entries
            if self.indexer is not None:
                _, istate = self.indexer(x, start, state.indexer)
                new_state.indexer = istate
                cmp_idx = self.indexer.select(x, qr, positions, istate.entries, self.index_topk)
            else:  # HCA: every complete window is visible
                n_cmp = entries.shape[0]
                cmp_idx = torch.arange(n_cmp, device=x.device)[None, :].expand(n, n_cmp)
                cmp_idx = cmp_idx.masked_fill(
                    cmp_idx >= ((positions + 1) // self.compressor.ratio)[:, None], -1
                )
            cmp_idx = torch.where(cmp_idx >= 0, cmp_idx + keys.shape[0], cmp_idx)
            buf, indices = torch.cat((keys, entries)), torch.cat((win_idx, cmp_idx), dim=1)

        o = sparse_attention(q, buf, indices, self.sinks, hd**-0.5)
        return self.output(o, cos, sin), new_state

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (q low-rank qr [n, q_lora], rotated q [n, H, D], the K = V row each
        token caches [n, D], QAT-rounded like the reference's cache)."""
        n = x.shape[0]
        q_in, kv_in = project_all(x, self.fused_in, self.q_a_proj, self.kv_proj)
        qr = self.q_a_norm(q_in)
        q = self.q_norm(self.q_b_proj(qr).view(n, self.n_heads, self.head_dim))
        q = apply_rope(q, cos, sin)
        # the cache holds the nope dims in FP8 under QAT, the RoPE dims in bf16
        kv = rope_round_fp8(self.kv_norm(kv_in), cos, sin, self.nope_dim, self.qat)
        return qr, q, kv

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention output [n, H, D] -> [n, hidden]: inverse RoPE, grouped projections."""
        o = apply_rope(o, cos, sin, inverse=True)  # V carried RoPE; make it relative again
        o = self.o_a_proj(o.reshape(o.shape[0], self.o_groups, -1)).flatten(1)
        o = self.o_b_proj(o)
        return self.tp.all_reduce(o) if self.tp.is_parallel else o
