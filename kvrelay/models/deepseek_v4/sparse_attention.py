"""Sparse MQA with per-head sinks over gathered K = V entries: the torch reference for the kernel.

Each query row lists the entries it attends to (indices into one kv buffer, -1 = none), like
FlashMLA's sparse interface. The sink adds exp(sink_h) to the softmax denominator only.
"""

from __future__ import annotations

import torch

from kvrelay.models.deepseek_v4.precision import wide

_QUERY_BLOCK = 256  # bounds the gathered [queries, entries, dim] tensor


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [n, H, D]; kv: [M, D]; indices: [n, K] long (-1 invalid); sinks: [H] -> [n, H, D].

    Computed wide (fp32, or fp64 for fp64 inputs); returned in q's dtype.
    """
    return sparse_mqa_reference(q, kv, indices, None, None, sinks, scale)


def sparse_mqa_reference(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    idx_a: torch.Tensor,
    kv_b: torch.Tensor | None,
    idx_b: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Like `sparse_attention` over two sources at once (the window pool and the compressed
    pool, each indexed by its own rows): the contract of the Triton `sparse_mqa`."""
    sources = [(kv_a, idx_a)] if kv_b is None else [(kv_a, idx_a), (kv_b, idx_b)]
    wdt = wide(kv_a).dtype
    sink = wide(sinks).to(wdt)
    out = []
    for b in range(0, q.shape[0], _QUERY_BLOCK):
        qb = wide(q[b : b + _QUERY_BLOCK]).to(wdt)
        ib = [i[b : b + _QUERY_BLOCK] for _, i in sources]
        valid = torch.cat([i >= 0 for i in ib], dim=1)
        g = torch.cat(
            [kv[i.clamp(min=0)] for (kv, _), i in zip(sources, ib, strict=True)], dim=1
        ).to(wdt)
        logits = torch.einsum("nhd,nkd->nhk", qb, g) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        m = torch.maximum(logits.amax(dim=-1), sink[None, :])  # [nb, H]
        p = torch.exp(logits - m[..., None])
        denom = p.sum(dim=-1) + torch.exp(sink[None, :] - m)
        out.append(torch.einsum("nhk,nkd->nhd", p, g) / denom[..., None])
    if not out:
        return q.new_zeros(q.shape)
    return torch.cat(out).to(q.dtype)
