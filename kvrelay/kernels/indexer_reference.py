"""Torch reference of the lightning indexer's batched top-k over a paged index-key pool: the
oracle of kvrelay.kernels.triton_indexer and the engine's CPU path.

Same math as Indexer.scores / Indexer.select (kvrelay.models.deepseek_v4.indexer): gather each
query's keys, score sum_h w_h * ReLU(q_h . k_e) in fp32 (fp64 for fp64 inputs), -inf where
e >= n_visible, stable descending sort, first K = min(topk, N) columns, -1 where the chosen score
is -inf. fp8 keys are dequantized as the pool reads them (kvrelay.models.deepseek_v4.cache_pool._read_index_k):
(k.float() * scale).to(q.dtype). Query rows run in blocks sized from the shapes to bound memory;
no host syncs (CUDA-graph safe on the GPU).
"""

from __future__ import annotations

import torch

from kvrelay.kernels.precision import wide

__all__ = [
    "indexer_scores_reference",
    "indexer_topk_reference",
    "keys_of",
    "rows_per_block",
    "select_reference",
]

# Elements of the widest per-block intermediate ([rows, N, d] keys or [rows, h, N] scores).
_BLOCK_ELEMS = 1 << 25


def rows_per_block(n_cols: int, heads: int, head_dim: int) -> int:
    """Query rows per block so the gathered keys and per-head scores stay near _BLOCK_ELEMS."""
    return max(1, _BLOCK_ELEMS // max(1, n_cols * max(heads, head_dim)))


def keys_of(
    q: torch.Tensor, keys: torch.Tensor, key_scale: torch.Tensor | None, rows: torch.Tensor
) -> torch.Tensor:
    """[n, N, d] keys of the given pool rows, dequantized to q's dtype when a scale is given."""
    k = keys[rows]
    if key_scale is not None:
        k = (k.float() * key_scale[rows][..., None]).to(q.dtype)
    return k


def indexer_scores_reference(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    key_scale: torch.Tensor | None,
    key_rows: torch.Tensor,
    seq_of_token: torch.Tensor,
    n_visible: torch.Tensor,
) -> torch.Tensor:
    """[T, N] scores sum_h w[t,h] * ReLU(q[t,h] . key(e)) in fp32 (fp64 for fp64 q), -inf where
    e >= n_visible[t]. Column e of query t reads pool row key_rows[seq_of_token[t], e]; -1 rows
    (past a sequence's entries) are read as row 0 and masked."""
    t_count, h, d = q.shape
    n_cols = key_rows.shape[1]
    wq = wide(q)
    out = torch.empty(t_count, n_cols, dtype=wq.dtype, device=q.device)
    cols = torch.arange(n_cols, device=q.device)
    step = rows_per_block(n_cols, h, d)
    for b in range(0, t_count, step):
        e = min(b + step, t_count)
        rows = key_rows[seq_of_token[b:e].long()].long().clamp(min=0)
        k = wide(keys_of(q, keys, key_scale, rows))
        s = torch.einsum("nhd,nmd->nhm", wq[b:e], k).relu()
        score = torch.einsum("nhm,nh->nm", s, w[b:e].to(wq.dtype))
        visible = cols[None, :] < n_visible[b:e].long()[:, None]
        out[b:e] = score.masked_fill(~visible, float("-inf"))
    return out


def select_reference(score: torch.Tensor, topk: int) -> torch.Tensor:
    """[T, min(topk, N)] columns of the highest scores, highest first, ties lower column first,
    -1 where the chosen score is -inf (Indexer.select's rule)."""
    k = min(topk, score.shape[1])
    # Every NaN ranks above +inf whatever its sign: torch.sort on CUDA puts a negative NaN
    # last (on the CPU first), so the sign is dropped first and both devices agree.
    score = torch.where(score.isnan(), torch.full_like(score, float("nan")), score)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = score.gather(1, order)
    return torch.where(torch.isneginf(chosen), torch.full_like(order, -1), order)


def indexer_topk_reference(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    key_scale: torch.Tensor | None,
    key_rows: torch.Tensor,
    seq_of_token: torch.Tensor,
    n_visible: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """[T, K] int64, K = min(topk, N): per query the entry numbers (columns of key_rows, not pool
    rows) of the K highest scores, in descending score order with ties to the lower entry, then
    -1 where fewer than K entries are visible.

    q [T, h, d] (rotated, QAT-rounded), w [T, h] fp32 (already scaled), keys [M, d] (fp8 when
    key_scale [M] is given), key_rows [B, N], seq_of_token [T], n_visible [T].
    """
    t_count, h, d = q.shape
    n_cols = key_rows.shape[1]
    k = min(topk, n_cols)
    out = torch.empty(t_count, k, dtype=torch.int64, device=q.device)
    step = rows_per_block(n_cols, h, d)
    for b in range(0, t_count, step):
        e = min(b + step, t_count)
        score = indexer_scores_reference(
            q[b:e], w[b:e], keys, key_scale, key_rows, seq_of_token[b:e], n_visible[b:e]
        )
        out[b:e] = select_reference(score, topk)
    return out
