"""Torch reference for the paged KV cache: store and paged attention.

This is the oracle every Triton kernel is tested against and the attention path on CPU.
Cache layout: k_cache / v_cache are [num_pages, page_size, Hkv, D]; a token's slot is
page * page_size + offset.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, Hkv, D] into the caches at slot_mapping [T] (in place).

    Pure tensor indexing (no host sync), so it can be captured in a CUDA graph. Every slot
    must be valid (>= 0): padded batch entries should point at a reserved scratch page.
    """
    idx = slot_mapping.to(torch.long)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, idx, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, idx, v.to(v_cache.dtype))


@dataclass
class GatherPlan:
    """One forward's per-sequence ranges, shared by every layer: the host copies of the lengths
    and the slot index are built once per step, not once per layer and sequence."""

    lens: list[int]  # each sequence's context length
    cu: list[int]  # cu_seqlens_q on the host
    slots: torch.Tensor  # [sum(lens)] long: each sequence's token slots, back to back
    starts: list[int]  # where sequence b's rows begin in a gather by `slots`


def gather_plan(
    page_table: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, page_size: int
) -> GatherPlan:
    lens = seq_lens.tolist()  # host sync: fine for a reference
    cu = cu_seqlens_q.tolist()
    # A sequence with no new tokens (padding) reads nothing: its table row may be stale.
    used = [n if cu[b + 1] > cu[b] else 0 for b, n in enumerate(lens)]
    width = max(used, default=0)
    pos = torch.arange(width, device=page_table.device)
    table = page_table[: len(used), : -(-width // page_size)].to(torch.long)
    all_slots = table[:, pos // page_size] * page_size + pos % page_size  # [B, width]
    keep = pos[None, :] < torch.tensor(used, device=pos.device)[:, None]
    return GatherPlan(lens, cu, all_slots[keep], [0, *itertools.accumulate(used)])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    plan: GatherPlan | None = None,
) -> torch.Tensor:
    """Causal attention of packed new query tokens over the paged cache.

    q [T, Hq, D] holds B sequences back to back (cu_seqlens_q [B+1]); seq_lens [B] counts
    each sequence's whole context including its new tokens, whose K/V are already stored.
    Query i of a sequence with q_len new tokens sits at position seq_len - q_len + i.
    Query head h reads kv head h // (Hq // Hkv). Softmax in float32; output in q's dtype.
    `plan` (from `gather_plan`) may be shared by every layer of one forward.
    """
    if plan is None:
        plan = gather_plan(page_table, seq_lens, cu_seqlens_q, k_cache.shape[1])
    out = torch.zeros_like(q)  # rows past cu_seqlens_q[-1] (padding) stay zero
    # Every sequence's context in one gather per cache, [H, sum(lens), D] float32 as HF's SDPA
    # path sees it: each sequence's slice below has the values and strides a gather of its own
    # pages had (so the same SDPA kernel gives the same bits), at one gather per layer.
    k_all = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, plan.slots).transpose(0, 1).float()
    v_all = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, plan.slots).transpose(0, 1).float()
    q_all = q.transpose(0, 1).float()
    cu, starts = plan.cu, plan.starts
    for b, seq_len in enumerate(plan.lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        qs = q_all[None, :, start:end]  # [1, H, L, D]
        ks = k_all[None, :, starts[b] : starts[b + 1]]
        vs = v_all[None, :, starts[b] : starts[b + 1]]
        # Same SDPA calls HF makes (is_causal for a fresh prefill, no mask for one token),
        # so greedy outputs match it bit for bit; an explicit mask only for chunks.
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )
        elif q_len == 1:
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True)
        else:
            pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= pos[:, None]
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[start:end] = o[0].transpose(0, 1).to(q.dtype)
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual): new_residual = x + residual (in x's dtype), normed from it.

    The math and roundings are HF's LlamaRMSNorm: float32 inside, cast back, then the weight.
    """
    if residual is not None:
        x = x + residual
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype), x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, H, D]; cos/sin: [T, D] (both halves equal)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] holding gate then up; returns silu(gate) * up: [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
