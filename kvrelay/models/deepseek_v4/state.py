"""Per-request decoding state of DeepSeek-V4, as plain tensors (the engine maps it onto paged pools).

Everything a later chunk needs from the tokens already processed, per layer:
- `window`: the raw KV (K = V) of the last sliding_window - 1 tokens, [<= W-1, head_dim];
- compressed layers: a `CompressorState` for the main compressor (entries of head_dim);
- CSA layers also one for the indexer's compressor (the index keys, entries of index_head_dim).
Positions are implicit: the request's `num_tokens` so far; entry w of ratio r covers the
window that starts at token w * r.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    """Compressed entries emitted so far plus the partial window still being filled.

    entries:       [N, d]        emitted entries (normed, rotated, QAT-rounded), model dtype
    pending_kv:    [p, coff*d]   projected kv of the p < ratio tokens of the open window (wide)
    pending_score: [p, coff*d]   their gate logits + position bias (wide)
    prev_kv:       [ratio, d]    overlapping (ratio-4) compressors only: the first-half channels
    prev_score:    [ratio, d]    of the last closed window, which the next entry also pools over;
                                 None before the first window closes
    closed_heads:  ([m, ratio, d], [m, ratio, d]) overlapping compressors, after a call that
                   closed m windows: each one's first halves (its `prev` for the next entry), so
                   a paged cache can keep the prev state at page ends (prefix cache); not cloned
    closed_rows:   ([ratio, coff*d], [ratio, coff*d]) after a call that closed a window: the
                   last closed window's kv and score rows (a paged cache keeps the last two
                   windows' rows, cache_pool.py); not cloned
    """

    entries: torch.Tensor
    pending_kv: torch.Tensor
    pending_score: torch.Tensor
    prev_kv: torch.Tensor | None = None
    prev_score: torch.Tensor | None = None
    closed_heads: tuple[torch.Tensor, torch.Tensor] | None = None
    closed_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def empty(
        cls, dim: int, coff: int, dtype: torch.dtype, wide: torch.dtype, device: torch.device
    ) -> CompressorState:
        return cls(
            entries=torch.empty(0, dim, dtype=dtype, device=device),
            pending_kv=torch.empty(0, coff * dim, dtype=wide, device=device),
            pending_score=torch.empty(0, coff * dim, dtype=wide, device=device),
        )

    @property
    def num_entries(self) -> int:
        return self.entries.shape[0]

    def clone(self) -> CompressorState:
        def c(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.clone()

        return CompressorState(
            self.entries.clone(),
            self.pending_kv.clone(),
            self.pending_score.clone(),
            c(self.prev_kv),
            c(self.prev_score),
        )


@dataclass
class LayerState:
    window: torch.Tensor  # [<= sliding_window - 1, head_dim]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    # After a call: the K = V rows of all its new tokens (a paged cache keeps every row, so a
    # prefix cut at any page end has its window); not cloned.
    new_kv: torch.Tensor | None = None

    def clone(self) -> LayerState:
        return LayerState(
            self.window.clone(),
            None if self.compressor is None else self.compressor.clone(),
            None if self.indexer is None else self.indexer.clone(),
        )


@dataclass
class SequenceState:
    """One request: tokens processed so far and the state of every layer. The MTP block keeps
    its own SequenceState with a single layer."""

    num_tokens: int = 0
    layers: list[LayerState] = field(default_factory=list)

    def clone(self) -> SequenceState:
        return SequenceState(self.num_tokens, [s.clone() for s in self.layers])
