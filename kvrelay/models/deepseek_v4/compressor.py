"""KV compressor: pools every `ratio` tokens into one entry with a per-channel softmax gate.

Ratio 4 ("overlap"): entry w pools 8 slots, the first-half channels of window w-1 and the
second-half channels of window w, so the projections are 2*dim wide. Other ratios pool their
own window only. Entry w exists once its window is complete; it is RMS-normed, rotated at
position w * ratio and rounded like the reference's cache (QAT simulation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.models.deepseek_v4.norms import RMSNorm
from kvrelay.models.deepseek_v4.precision import wide, wide_dtype, wide_weight
from kvrelay.models.deepseek_v4.qat import hadamard_fp4, rope_round_fp8
from kvrelay.models.deepseek_v4.rope import RopeTable, apply_rope
from kvrelay.models.deepseek_v4.state import CompressorState

QUANT_NONE, QUANT_FP8, QUANT_FP4 = "none", "fp8", "fp4"


class Compressor(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        dim: int,
        ratio: int,
        overlap: bool,
        rope: RopeTable,
        rope_dim: int,
        norm_eps: float,
        quant: str = QUANT_NONE,
        dtype: torch.dtype = torch.float32,
        indexer: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.coff = 2 if overlap else 1
        self.rope, self.rope_dim, self.quant = rope, rope_dim, quant
        self.kv_proj = nn.Linear(hidden_size, self.coff * dim, bias=False, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, self.coff * dim, bias=False, dtype=dtype)
        self.position_bias = nn.Parameter(
            torch.zeros(ratio, self.coff * dim, dtype=wide_dtype(dtype))
        )
        self.kv_norm = RMSNorm(dim, norm_eps, dtype)
        if indexer is not None:
            # The CSA compressor carries the indexer only so parameter names match HF's
            # (`compressor.indexer.*`); attention drives the two separately.
            self.indexer = indexer

    def empty_state(self, device: torch.device | str = "cpu") -> CompressorState:
        dtype = self.kv_proj.weight.dtype
        return CompressorState.empty(self.dim, self.coff, dtype, wide_dtype(dtype), device)

    def forward(
        self, x: torch.Tensor, start: int, state: CompressorState
    ) -> tuple[torch.Tensor, CompressorState]:
        """Feed tokens start..start+n-1 (x: [n, hidden]); return the entries their arrival
        completes ([m, dim]) and the new state (which holds all entries so far)."""
        n, r, d = x.shape[0], self.ratio, self.dim
        if state.num_entries * r + state.pending_kv.shape[0] != start:
            raise ValueError("compressor state does not end where the new tokens start")
        xw = wide(x)
        # projections and gates in fp32 like the reference (weights may be bf16)
        kv = F.linear(xw, wide_weight(self.kv_proj.weight))
        slot = torch.arange(start, start + n, device=x.device) % r
        score = F.linear(xw, wide_weight(self.gate_proj.weight)) + self.position_bias[slot]
        kv_all = torch.cat((state.pending_kv, kv))
        score_all = torch.cat((state.pending_score, score))
        m = kv_all.shape[0] // r
        closed_kv = kv_all[: m * r].view(m, r, self.coff * d)
        closed_score = score_all[: m * r].view(m, r, self.coff * d)

        prev_kv, prev_score = state.prev_kv, state.prev_score
        heads = None
        if m == 0:
            new = torch.empty(0, d, dtype=state.entries.dtype, device=x.device)
        else:
            if self.overlap:
                if prev_kv is None:  # first window of the sequence: no previous half
                    prev_kv = kv_all.new_zeros(r, d)
                    prev_score = kv_all.new_full((r, d), float("-inf"))
                first_kv = torch.cat((prev_kv[None], closed_kv[:-1, :, :d]))
                first_score = torch.cat((prev_score[None], closed_score[:-1, :, :d]))
                slots_kv = torch.cat((first_kv, closed_kv[:, :, d:]), dim=1)
                slots_score = torch.cat((first_score, closed_score[:, :, d:]), dim=1)
                prev_kv, prev_score = closed_kv[-1, :, :d], closed_score[-1, :, :d]
                heads = (closed_kv[:, :, :d], closed_score[:, :, :d])
            else:
                slots_kv, slots_score = closed_kv, closed_score
            pooled = (slots_score.softmax(dim=1) * slots_kv).sum(dim=1)
            positions = (state.num_entries + torch.arange(m, device=x.device)) * r
            cos, sin = self.rope.cos_sin(positions, pooled.dtype)
            new = self._finish(pooled, cos, sin).to(state.entries.dtype)

        return new, CompressorState(
            entries=torch.cat((state.entries, new)),
            pending_kv=kv_all[m * r :],
            pending_score=score_all[m * r :],
            prev_kv=prev_kv,
            prev_score=prev_score,
            closed_heads=heads,
            closed_rows=(closed_kv[-1], closed_score[-1]) if m else None,
        )

    def _finish(self, pooled: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Norm, rotate at the window's first token (cos, sin), and round like the cache would."""
        entries = self.kv_norm(pooled)
        if self.quant == QUANT_FP4:
            return hadamard_fp4(apply_rope(entries, cos, sin))
        nope = self.dim - self.rope_dim
        return rope_round_fp8(entries, cos, sin, nope, self.quant == QUANT_FP8)
