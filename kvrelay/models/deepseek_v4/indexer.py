"""Lightning indexer of CSA layers: its own ratio-4 compressor makes the index keys; each query
scores the visible keys and keeps the top-k.

Top-k ties break towards the lower entry index (a stable sort). torch.topk leaves the order of
equal scores unspecified and it changes with the row length, so with it the selection for
token t would depend on how many entries exist after t; exact ties are common, because a score
is 0.0 whenever every head's ReLU(q . k) is 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.layers.parallel import SINGLE
from kvrelay.models.deepseek_v4.compressor import QUANT_FP4, QUANT_NONE, Compressor
from kvrelay.models.deepseek_v4.precision import wide, wide_weight
from kvrelay.models.deepseek_v4.qat import hadamard_fp4
from kvrelay.models.deepseek_v4.rope import RopeTable, apply_rope

_QUERY_BLOCK = 256  # bounds the [queries, heads, entries] score tensor


class IndexerScorer(nn.Module):
    """Per-query head weights (HF keeps `weights_proj` under `scorer`)."""

    def __init__(self, hidden_size: int, n_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False, dtype=dtype)


class Indexer(Compressor):
    """A compressor of index_head_dim (its forward makes index keys) plus the query side."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        ratio: int,
        rope: RopeTable,
        rope_dim: int,
        norm_eps: float,
        qat: bool,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        quant = QUANT_FP4 if qat else QUANT_NONE
        super().__init__(hidden_size, head_dim, ratio, True, rope, rope_dim, norm_eps, quant, dtype)
        self.n_heads = n_heads
        # Tensor parallel: this rank scores with its n_heads of `all_heads`; the partial scores
        # are summed over ranks before top-k, so every rank selects the same entries.
        self.all_heads, self.tp = n_heads, SINGLE
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False, dtype=dtype)
        self.scorer = IndexerScorer(hidden_size, n_heads, dtype)

    def scores(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """[n, N] index scores sum_h w_h * ReLU(q_h . k_j); -inf where entry j is not yet
        visible to the query (j >= (t + 1) // ratio)."""
        n = x.shape[0]
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        q, w = self.query(x, qr, cos, sin)
        q, k = wide(q), wide(keys)
        out = []
        for b in range(0, n, _QUERY_BLOCK):
            s = torch.einsum("nhd,md->nhm", q[b : b + _QUERY_BLOCK], k).relu()
            out.append(torch.einsum("nhm,nh->nm", s, w[b : b + _QUERY_BLOCK]))
        score = torch.cat(out) if out else q.new_zeros(0, k.shape[0])
        if self.tp.is_parallel:
            self.tp.all_reduce(score)
        visible = (
            torch.arange(k.shape[0], device=x.device)[None, :]
            < ((positions + 1) // self.ratio)[:, None]
        )
        return score.masked_fill(~visible, float("-inf"))

    def query(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        head_w: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(index queries [n, h, d], rotated and rounded like the keys; head weights [n, h]
        wide, with the d^-1/2 h^-1/2 scale folded in). `head_w`: the weights_proj projection
        of x if computed already (wide, unscaled: the fused wide GEMM)."""
        h, d = self.n_heads, self.dim
        q = apply_rope(self.q_b_proj(qr).view(-1, h, d), cos, sin)
        if self.quant == QUANT_FP4:
            q = hadamard_fp4(q)
        if head_w is None:
            head_w = F.linear(wide(x), wide_weight(self.scorer.weights_proj.weight))
        scale = d**-0.5 * self.all_heads**-0.5  # every head of the model, not of this rank
        return q, head_w * scale

    def select(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        topk: int,
    ) -> torch.Tensor:
        """[n, min(topk, N)] indices of the chosen entries per query, -1 where fewer are visible."""
        score = self.scores(x, qr, positions, keys)
        k = min(topk, keys.shape[0])
        # Every NaN ranks above +inf whatever its sign: torch.sort on CUDA puts a negative NaN
        # last (on the CPU first), so the sign is dropped first and both devices agree.
        score = torch.where(score.isnan(), torch.full_like(score, float("nan")), score)
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :k]
        chosen = score.gather(1, order)
        return torch.where(torch.isneginf(chosen), torch.full_like(order, -1), order)
