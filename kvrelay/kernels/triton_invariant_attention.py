"""Paged attention whose every query row has the same bits whatever else is in its batch: the
attention of `--deterministic` on the GPU (issue 22). Semantics: kernels.reference.paged_attention
(causal, GQA, float32 softmax).

Why the default kernels are not invariant: the decode kernel splits a row's keys over as many
programs as the batch leaves SMs free (split-K, then a combine), and a prefill row is computed by
another kernel, in query tiles whose size follows the chunk. Here one program serves one (query
token, kv head) for decode and prefill rows alike: its G query heads are the rows of a tile of
fixed shape [BLOCK_G, HEAD_DIM], and it walks the row's keys from position 0 in blocks of BLOCK_N
at fixed places, in ascending order, with an online softmax. The trip count and every tile shape
depend on the row's own position alone. Keys past the position are masked to -inf inside the
last block (their probabilities are exactly 0). Prefill pays for this: each row reloads its keys
(no query tiling), so a chunk of T tokens reads O(T * context) keys.

Torch reference: kernels.reference.paged_attention (and layers/batch_invariant_attention.py, the
CPU mode's invariant schedule: the same blocks of 64 keys).
"""

from __future__ import annotations

import torch

from kvrelay.kernels.reference import store_kv
from kvrelay.kernels.triton_pointwise import _jit, tl, triton

__all__ = ["invariant_paged_attention", "store_kv"]

BLOCK_N = 64  # keys per block, at absolute positions [j * 64, (j + 1) * 64): never chosen by shape


@_jit(varying=("n_rows", "num_seqs"))
def _invariant_attention_kernel(
    q_ptr, k_ptr, v_ptr, pt_ptr, seq_lens_ptr, cu_ptr, out_ptr, n_rows, num_seqs, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_pt,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    row, kv_head = tl.program_id(0), tl.program_id(1)
    # The row's sequence: how many sequences end at or before it (cu_seqlens_q is sorted).
    seq = row * 0  # an int32 scalar, as the loop makes it
    for b in range(1, num_seqs + 1):
        seq += (tl.load(cu_ptr + b) <= row).to(tl.int32)
    if seq < num_seqs:  # rows past cu_seqlens_q[-1] are padding: their output stays zero
        q_end = tl.load(cu_ptr + seq + 1)
        pos = tl.load(seq_lens_ptr + seq) - (q_end - row)  # this token's position
        heads = kv_head * G + tl.arange(0, BLOCK_G)
        head_ok = tl.arange(0, BLOCK_G) < G
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
            head_ok[:, None],
            0.0,
        )
        m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        den = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, HEAD_DIM), tl.float32)
        for start in range(0, pos + 1, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            visible = kpos <= pos
            page = tl.load(pt_ptr + seq.to(tl.int64) * stride_pt + kpos // PAGE_SIZE, visible, 0)
            off = kpos % PAGE_SIZE
            k = tl.load(
                k_ptr + page[:, None].to(tl.int64) * stride_kp + off[:, None] * stride_ks
                + kv_head * stride_kh + dims[None, :],
                visible[:, None],
                0.0,
            )  # fmt: skip
            v = tl.load(
                v_ptr + page[:, None].to(tl.int64) * stride_vp + off[:, None] * stride_vs
                + kv_head * stride_vh + dims[None, :],
                visible[:, None],
                0.0,
            )  # fmt: skip
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(visible[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            den = den * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        out = acc / den[:, None]
        tl.store(
            out_ptr + row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            head_ok[:, None],
        )


def invariant_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D]; caches [pages, page_size, Hkv, D] holding every row's keys up to its
    position; page_table [B, max_pages] int32; seq_lens [B] int32 (context with the new tokens);
    cu_seqlens_q [B + 1] int32. Rows past cu_seqlens_q[-1] come back zero. No host sync: graph
    capture takes it."""
    t, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    strided = q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1
    if hq % hkv or d != triton.next_power_of_2(d) or strided:
        raise ValueError(f"q heads {hq} / kv heads {hkv}, head dim {d}: not supported")
    g = hq // hkv
    out = torch.zeros_like(q)
    if t == 0:
        return out
    _invariant_attention_kernel[(t, hkv)](
        q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, out,
        t, seq_lens.shape[0], scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), page_table.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), HEAD_DIM=d, PAGE_SIZE=page_size,
        BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    return out
