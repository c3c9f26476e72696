"""DeepSeek-V4 attention of one layer over a varlen batch, reading and writing the paged pools
directly: the batched form of `Attention.forward` (same projections, same roundings).

Order within the layer: project; store every row's K = V in the window pool; run the
compressors, which store the entries their rows complete; select compressed entries (all
visible ones for HCA, the indexer's top-k for CSA); attend over [window ∪ entries] by pool
row. Every token therefore sees exactly what the per-sequence reference shows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvrelay.kernels.indexer_reference import indexer_scores_reference, select_reference
from kvrelay.models.deepseek_v4.attention import Attention
from kvrelay.models.deepseek_v4.batch_meta import BatchMeta, StepIndex
from kvrelay.models.deepseek_v4.fused_projections import project_wide
from kvrelay.models.deepseek_v4.fusion import fusable
from kvrelay.models.deepseek_v4.pooled_compressor import (
    PoolWindows,
    compress_step,
    pool_windows_reference,
)


@dataclass(frozen=True)
class AttentionOps:
    """The gather-heavy ops, torch references or Triton kernels with the same contract:
    sparse_mqa(q, kv_a, idx_a, kv_b, idx_b, sinks, scale) -> [T, H, D];
    indexer_topk(q, w, keys, key_scale, key_rows, seq, n_visible, topk) -> [T, K] entries;
    pool_windows: the compressors' window gather + pooling (`pool_windows_reference`)."""

    sparse_mqa: Callable
    indexer_topk: Callable
    pool_windows: PoolWindows = pool_windows_reference


def pooled_attention(
    attn: Attention,
    x: torch.Tensor,
    layer: int,
    meta: BatchMeta,
    index: StepIndex,
    pool,
    ops: AttentionOps,
) -> torch.Tensor:
    """x: [T, hidden] normed inputs of every row -> [T, hidden]."""
    hd = attn.head_dim
    cos, sin = index.rope(attn.rope, x.dtype)
    qr, q, kv = attn.project(x, cos, sin)

    swa = pool.swa[layer].flatten(0, 1)
    swa.index_copy_(0, index.swa_rows(), kv.to(swa.dtype))
    win_idx = index.window_idx()
    if attn.compressor is None:
        o = ops.sparse_mqa(q, swa, win_idx, None, None, attn.sinks, hd**-0.5)
    else:
        comp = attn.compressor
        r = comp.ratio
        entries = pool.entries[layer].flatten(0, 1)

        def store_entries(rows: torch.Tensor, e: torch.Tensor) -> None:
            entries.index_copy_(0, rows, e.to(entries.dtype))

        wide_in = project_wide(x, attn.fused_wide, *attn.wide_linears())
        _compress(comp, x, wide_in[:2], meta, index, pool.comp_slots[layer], store_entries, ops)
        if attn.indexer is not None:
            _compress(
                attn.indexer, x, wide_in[2:4], meta, index, pool.index_slots[layer],
                lambda rows, e: pool.store_index_k(layer, rows, e), ops,
            )  # fmt: skip
            cmp_idx = _select(attn, x, qr, wide_in[4], cos, sin, meta, index, pool, layer, ops)
        else:  # HCA: every complete window is visible
            cmp_idx = index.all_entries_idx(r)
        o = ops.sparse_mqa(q, swa, win_idx, entries, cmp_idx, attn.sinks, hd**-0.5)
    return attn.output(o, cos, sin)


def _compress(comp, x, kv_gate, meta: BatchMeta, index: StepIndex, slots, store, ops) -> None:
    """`kv_gate`: the compressor's two wide projections of x (this step's rows)."""
    plan = index.compress_plan(comp.ratio)
    cos_sin = index.rope(comp.rope, x.dtype, plan.window_start)
    page_prev = (slots.page_prev_kv, slots.page_prev_score) if slots.overlap else None
    compress_step(
        comp, *kv_gate, meta, plan, cos_sin, slots.pending_kv, slots.pending_score,
        slots.prev_kv, slots.prev_score, store, ops.pool_windows, page_prev,
    )  # fmt: skip


def _select(
    attn, x, qr, head_w, cos, sin, meta, index: StepIndex, pool, layer: int, ops
) -> torch.Tensor:
    """[T, K] pool rows of the indexer's top-k entries (-1 where fewer are visible); `head_w`:
    the indexer's head-weight projection of x (wide, unscaled)."""
    ix = attn.indexer
    r = ix.ratio
    q, w = ix.query(x, qr, cos, sin, head_w)
    keys, scale = pool.index_k_rows(layer)
    rows = index.entry_rows(r)
    if ix.tp.is_parallel:  # partial scores of this rank's heads, summed before the top-k
        score = indexer_scores_reference(q, w, keys, scale, rows, meta.seq, index.visible(r))
        chosen = select_reference(ix.tp.all_reduce(score), attn.index_topk)
    else:
        chosen = ops.indexer_topk(
            q, w, keys, scale, rows, meta.seq, index.visible(r), attn.index_topk
        )
    return rows_of_chosen(rows, meta.seq, chosen)


@fusable
def rows_of_chosen(rows: torch.Tensor, seq: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """[T, K] pool rows of each row's chosen entries (`rows`: [B, E] per sequence), -1 kept."""
    return torch.where(chosen >= 0, rows[seq[:, None], chosen.clamp(min=0)], -1)
