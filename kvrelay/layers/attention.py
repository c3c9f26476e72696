"""Attention metadata for one forward pass and the backends behind one small interface."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kvrelay.kernels.reference import GatherPlan


@dataclass
class AttentionMetadata:
    """Where the batch's new tokens go in the paged cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] page * page_size + offset for every new token
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32, context length including the new tokens
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    max_q_len: int
    is_decode: bool  # every sequence has exactly one new token
    # The torch path's per-step gather plan: built by the first layer, shared by the rest.
    gather: GatherPlan | None = field(default=None, repr=False, compare=False)


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


class TorchAttention:
    """The reference path: runs anywhere, and is the oracle for the Triton kernels."""

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        from kvrelay.kernels import reference

        reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.gather is None:
            meta.gather = reference.gather_plan(
                meta.page_table, meta.seq_lens, meta.cu_seqlens_q, k_cache.shape[1]
            )
        return reference.paged_attention(
            q, k_cache, v_cache, meta.page_table, meta.seq_lens, meta.cu_seqlens_q, scale,
            meta.gather,
        )  # fmt: skip


class TritonAttention:
    """GPU path: a split-K decode kernel for decode-only batches, a varlen kernel otherwise."""

    def __init__(self) -> None:
        from kvrelay.kernels import triton_attention

        self._k = triton_attention

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        self._k.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            return self._k.paged_decode_attention(
                q, k_cache, v_cache, meta.page_table, meta.seq_lens, scale
            )
        return self._k.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.page_table,
            meta.seq_lens,
            meta.cu_seqlens_q,
            scale,
            meta.max_q_len,
        )


class InvariantTritonAttention:
    """GPU `--deterministic`: one kernel for decode and prefill rows whose every row has the
    same bits whatever else is in the batch (kernels/triton_invariant_attention.py)."""

    def __init__(self) -> None:
        from kvrelay.kernels import triton_invariant_attention

        self._k = triton_invariant_attention

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        self._k.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._k.invariant_paged_attention(
            q, k_cache, v_cache, meta.page_table, meta.seq_lens, meta.cu_seqlens_q, scale
        )


def make_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r} (torch | triton)")
