"""Batch-invariant attention (`--deterministic`): dense paged attention, DeepSeek-V4 sparse MQA
with sinks, and the lightning indexer's scores, for the CPU torch path.

Why the references are not invariant: they reduce over as many keys (or entries) as the batch
brings (the longest context, the widest top-k list), and a dense query row takes another SDPA
path when it decodes alone than inside a prefill chunk. Here every query row reduces over keys in
blocks of KEYS at fixed places (absolute positions for dense KV; the column of its own index list
for sparse), in ascending order, with an online softmax across blocks. A block a row cannot see
is an exact no-op for it (its max leaves the running max alone, rescales by exp(0) = 1 and adds
zeros), so extra blocks other rows need change nothing. Every product and reduction runs inside
`batch_invariant.scope`, blocked over query rows: one fixed shape per call.
"""

from __future__ import annotations

import torch

from kvrelay.kernels.indexer_reference import keys_of, select_reference
from kvrelay.kernels.precision import wide
from kvrelay.kernels.reference import store_kv
from kvrelay.layers.batch_invariant import ROWS

KEYS = 64  # keys (or entries) per block


def _online_step(state, s: torch.Tensor, values: torch.Tensor, eq: str):
    """One block of the online softmax. state (m, den, acc): running max [N, *heads], sum
    [N, *heads] and weighted values [N, *heads, D]; s [N, *heads, KEYS] logits (-inf: masked);
    `eq` multiplies the probabilities by `values`."""
    m, den, acc = state
    m_new = torch.maximum(m, s.amax(dim=-1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new[..., None])
    den = den * alpha + p.sum(dim=-1)
    acc = acc * alpha[..., None] + torch.einsum(eq, p, values)
    return m_new, den, acc


def _pad_cols(idx: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, K rounded up to KEYS] with -1 (nothing) in the new columns."""
    pad = -idx.shape[1] % KEYS
    return torch.nn.functional.pad(idx, (0, pad), value=-1) if pad else idx


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`kernels.reference.paged_attention`'s contract (causal, GQA, float32 softmax), each query
    row reducing over key blocks [j*KEYS, (j+1)*KEYS) of absolute positions, all rows of the
    batch together (blocks past a row's position are no-ops for it)."""
    t, hq, d = q.shape
    hkv, page = k_cache.shape[2], k_cache.shape[1]
    lens, cu = seq_lens.tolist(), cu_seqlens_q.tolist()  # host sync: the CPU path
    seq = torch.repeat_interleave(
        torch.arange(len(lens), device=q.device),
        torch.tensor([cu[b + 1] - cu[b] for b in range(len(lens))], device=q.device),
    )
    n = seq.shape[0]
    pos = torch.cat(
        [torch.arange(lens[b] - (cu[b + 1] - cu[b]), lens[b]) for b in range(len(lens))]
    ).to(q.device)
    qs = q[:n].float()
    # Whole blocks of query rows from the start (padding: sequence 0's position 0), so the
    # blocked ops below split without copying.
    pad = -n % ROWS
    if pad:
        seq = torch.cat([seq, seq.new_zeros(pad)])
        pos = torch.cat([pos, pos.new_zeros(pad)])
        qs = torch.cat([qs, qs.new_zeros(pad, hq, d)])
    table = page_table.long()[seq]  # [n + pad, pages]
    qs = qs.view(n + pad, hkv, hq // hkv, d)  # query head h reads kv head h // group
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    state = (
        torch.full((n + pad, hkv, hq // hkv), float("-inf"), device=q.device),
        torch.zeros(n + pad, hkv, hq // hkv, device=q.device),
        torch.zeros(n + pad, hkv, hq // hkv, d, device=q.device),
    )
    offs = torch.arange(KEYS, device=q.device)
    for j in range(0, max(lens), KEYS):
        kpos = j + offs  # [KEYS]
        visible = kpos[None, :] <= pos[:, None]  # [n, KEYS]
        page_col = (kpos // page).clamp(max=table.shape[1] - 1)
        rows = torch.where(visible, table[:, page_col] * page + kpos % page, 0)
        k = k_flat[rows].float()  # [n, KEYS, hkv, d]
        v = v_flat[rows].float()
        s = torch.einsum("nhgd,nkhd->nhgk", qs, k) * scale
        s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
        state = _online_step(state, s, v, "nhgk,nkhd->nhgd")
    _, den, acc = state
    out = torch.zeros_like(q)  # rows past cu_seqlens_q[-1] (padding) stay zero
    out[:n] = (acc[:n] / den[:n, ..., None]).reshape(n, hq, d).to(q.dtype)
    return out


class BatchInvariantAttention:
    """The dense attention backend of `--deterministic` (AttentionBackend's contract)."""

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(
            q, k_cache, v_cache, meta.page_table, meta.seq_lens, meta.cu_seqlens_q, scale
        )


def sparse_mqa(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    idx_a: torch.Tensor,
    kv_b: torch.Tensor | None,
    idx_b: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`sparse_mqa_reference`'s contract: the window source's columns, then the compressed
    source's, each in blocks of KEYS columns; the sink starts the running max and sum."""
    wq = wide(q)
    n, h, _ = q.shape
    sink = wide(sinks).to(wq.dtype)
    state = (
        sink[None, :].expand(n, h).contiguous(),
        torch.ones(n, h, dtype=wq.dtype, device=q.device),  # exp(sink - sink)
        torch.zeros_like(wq),
    )
    sources = [(kv_a, idx_a)] if kv_b is None else [(kv_a, idx_a), (kv_b, idx_b)]
    for kv, idx in sources:
        idx = _pad_cols(idx)
        for j in range(0, idx.shape[1], KEYS):
            cols = idx[:, j : j + KEYS]
            g = wide(kv[cols.clamp(min=0)]).to(wq.dtype)  # [n, KEYS, D]
            s = torch.einsum("nhd,nkd->nhk", wq, g) * scale
            s = s.masked_fill((cols < 0)[:, None, :], float("-inf"))
            state = _online_step(state, s, g, "nhk,nkd->nhd")
    _, den, acc = state
    return (acc / den[..., None]).to(q.dtype)


def indexer_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    key_scale: torch.Tensor | None,
    key_rows: torch.Tensor,
    seq_of_token: torch.Tensor,
    n_visible: torch.Tensor,
) -> torch.Tensor:
    """`indexer_scores_reference`'s contract, entries scored KEYS columns at a time (the
    reference's blocks follow the batch's widest entry list)."""
    wq = wide(q)
    n_cols = key_rows.shape[1]
    rows_all = _pad_cols(key_rows.long())[seq_of_token.long()]  # [T, N padded]
    cols = torch.arange(rows_all.shape[1], device=q.device)
    visible = cols[None, :] < n_visible.long()[:, None]
    parts = []
    for j in range(0, rows_all.shape[1], KEYS):
        k = keys_of(q, keys, key_scale, rows_all[:, j : j + KEYS].clamp(min=0))
        s = torch.einsum("nhd,nmd->nhm", wq, wide(k)).relu()
        parts.append(torch.einsum("nhm,nh->nm", s, w.to(wq.dtype)))
    score = torch.cat(parts, dim=1).masked_fill(~visible, float("-inf"))
    return score[:, :n_cols]


def indexer_topk(q, w, keys, key_scale, key_rows, seq_of_token, n_visible, topk):
    """`indexer_topk_reference`'s contract on the invariant scores (the stable sort is exact)."""
    score = indexer_scores(q, w, keys, key_scale, key_rows, seq_of_token, n_visible)
    return select_reference(score, topk)
