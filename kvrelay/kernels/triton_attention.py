"""Triton paged attention: a flash-attention kernel for prefill / chunked / mixed batches and a
split-K (flash-decoding) kernel for decode. Semantics match kvrelay.kernels.reference.

Cache layout [num_pages, page_size, Hkv, D]; page_table [B, max_pages] int32; seq_lens [B] int32
count each sequence's whole context including its new tokens (already stored in the cache).
Both kernels pack the G = Hq // Hkv query heads of one kv head into the rows of one tile, so a
kv tile is loaded once per group (GQA) and decode tokens still fill an MMA tile.
"""

from __future__ import annotations

import functools
import math

import torch

from kvrelay.kernels.reference import store_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the module imports, the kernels refuse to run
    triton = None
    tl = None

__all__ = ["paged_attention", "paged_decode_attention", "store_kv", "default_num_splits"]

_LOG2E = 1.4426950408889634


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q,
    k_cache_ptr,
    v_cache_ptr,
    pt_row_ptr,
    start_n,
    kv_end,
    pos,
    qk_scale,
    kv_head,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One online-softmax step over keys [start_n, start_n + BLOCK_N).

    MASKED tiles drop keys >= kv_end and keys after each row's position (causal);
    unmasked tiles are known to be fully visible to every row.
    """
    n = start_n + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    if MASKED:
        n_ok = n < kv_end
        page = tl.load(pt_row_ptr + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        page = tl.load(pt_row_ptr + n // PAGE_SIZE).to(tl.int64)
    in_page = n % PAGE_SIZE
    k_off = page * stride_kp + in_page * stride_ks + kv_head * stride_kh
    v_off = page * stride_vp + in_page * stride_vs + kv_head * stride_vh
    if MASKED:
        kt = tl.load(k_cache_ptr + k_off[None, :] + d[:, None], mask=n_ok[None, :], other=0.0)
    else:
        kt = tl.load(k_cache_ptr + k_off[None, :] + d[:, None])
    s = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale
    if MASKED:
        s = tl.where((n[None, :] <= pos[:, None]) & n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@_jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    page_table_ptr,
    seq_lens_ptr,
    cu_q_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    G: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # One program: BLOCK_Q query tokens x G heads of one kv head of one sequence. The last
    # (longest, causal) query blocks start first so the short ones fill the tail.
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    first = q_block * BLOCK_Q
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    tok = first + rows // G
    head = kv_head * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (tok < q_len)
    pos = ctx + tok
    d = tl.arange(0, HEAD_DIM)
    q_off = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)

    # Finite start so fully masked (padding) rows never make NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    pt_row_ptr = page_table_ptr + b.to(tl.int64) * stride_pt

    first_pos = ctx + first
    kv_end = ctx + tl.minimum(first + BLOCK_Q, q_len)  # one past the block's last position
    n_full = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys below are visible to every row
    for start_n in range(0, n_full, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, pt_row_ptr, start_n, kv_end, pos,
            qk_scale, kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, PAGE_SIZE, HEAD_DIM, BLOCK_N, False, DOT_PREC,
        )  # fmt: skip
    for start_n in range(n_full, kv_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, pt_row_ptr, start_n, kv_end, pos,
            qk_scale, kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, PAGE_SIZE, HEAD_DIM, BLOCK_N, True, DOT_PREC,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(
        out_ptr + o_off[:, None] + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


@_jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    seq_lens_ptr,
    part_o_ptr,
    part_lse_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    num_q_heads,
    num_splits,
    G: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # One program: one (sequence, kv head, split), all G query heads of that kv head.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # Split length from the sequence's own length (read on device), rounded to whole tiles.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    h = tl.arange(0, BLOCK_H)
    h_ok = h < G
    head = kv_head * G + h
    d = tl.arange(0, HEAD_DIM)
    q_off = b.to(tl.int64) * stride_qb + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=h_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    pt_row_ptr = page_table_ptr + b.to(tl.int64) * stride_pt
    # Every row of a decode token sees the whole split, so pos only needs to exceed it.
    pos = tl.full([BLOCK_H], 0, tl.int32) + end
    for start_n in range(start, end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, pt_row_ptr, start_n, end, pos,
            qk_scale, kv_head, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, PAGE_SIZE, HEAD_DIM, BLOCK_N, True, DOT_PREC,
        )  # fmt: skip

    # Empty split: lse = -inf and o = 0, which the combine weighs as nothing.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    out = acc / l_safe[:, None]
    row = (b * num_q_heads + head).to(tl.int64) * num_splits + split
    tl.store(part_lse_ptr + row, lse, mask=h_ok)
    tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=h_ok[:, None])


@_jit
def _decode_combine_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_q_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # One program: one (sequence, query head); merges its splits by their log-sum-exp.
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, HEAD_DIM)
    row = (b * num_q_heads + h).to(tl.int64) * num_splits
    lse = tl.load(part_lse_ptr + row + s, mask=s_ok, other=float("-inf"))
    m = tl.maximum(tl.max(lse, 0), -1.0e30)  # finite even when every split is empty
    w = tl.exp2(lse - m)  # empty splits (lse = -inf) weigh 0
    o = tl.load(
        part_o_ptr + (row + s)[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None], other=0.0
    )
    total = tl.sum(w, 0)
    # seq_len 0 (a padded CUDA-graph slot): every split is empty and the output is 0.
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    o_off = b.to(tl.int64) * stride_ob + h * stride_oh
    tl.store(out_ptr + o_off + d, out.to(out_ptr.dtype.element_ty))


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if triton is None:
        raise RuntimeError("triton is not installed; use kvrelay.kernels.reference instead")
    num_q_heads, head_dim = q.shape[-2], q.shape[-1]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head dim must be a power of two >= 16, got {head_dim}")
    if page_size & (page_size - 1):
        raise ValueError(f"page size must be a power of two, got {page_size}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the last dim of q and the caches must be contiguous")
    return num_q_heads, num_kv_heads, head_dim


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    return out


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 dots would silently run in tf32; "ieee" keeps fp32 inputs exact to ~1e-6.
    return "ieee" if dtype == torch.float32 else "tf32"


def _prefill_config(max_q_len: int, g: int, head_dim: int) -> dict[str, int]:
    """Tile sizes and launch options of the prefill kernel."""
    # Best of 36 configs on the H200 (1 x 4096 tokens, bf16, Hq=32, Hkv=8): 128 x 128 tiles
    # for D=64, 64 x 64 for D=128; 4 warps, 2 stages for both.
    tile = 128 if head_dim <= 64 else 64
    # Rows of a tile are (token, head-in-group) pairs: small for decode-heavy batches.
    block_m = min(tile, max(16, triton.next_power_of_2(max_q_len * g)))
    block_m = max(block_m, triton.next_power_of_2(g))
    return {"BLOCK_M": block_m, "BLOCK_N": tile, "num_warps": 4, "num_stages": 2}


def _decode_config(g: int, head_dim: int) -> dict[str, int]:
    """Tile size and launch options of the decode split kernel.

    Within 2% of the best of 27 configs over batch 1..256 x context 1k..16k on the H200.
    """
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    max_q_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens [T, Hq, D] over the paged cache (see reference).

    max_q_len (a Python int, >= every sequence's new-token count) sizes the grid. Rows past
    cu_seqlens_q[-1] are not written. out, if given, is written in place and returned.
    """
    num_q_heads, num_kv_heads, head_dim = _check(q, k_cache, v_cache)
    g = num_q_heads // num_kv_heads
    batch = seq_lens.shape[0]
    out = _output(q, out)
    if batch == 0 or max_q_len <= 0 or q.shape[0] == 0:
        return out
    cfg = _prefill_config(max_q_len, g, head_dim)
    block_q = cfg["BLOCK_M"] // g
    grid = (triton.cdiv(max_q_len, block_q), batch, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, page_table, seq_lens, cu_seqlens_q,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        page_table.stride(0),
        G=g, PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_Q=block_q, DOT_PREC=_dot_precision(q.dtype), **cfg,
    )  # fmt: skip
    return out


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter on CPU: pretend to be an H200


def default_num_splits(
    batch: int, num_kv_heads: int, max_context: int, device: torch.device
) -> int:
    """Splits per (sequence, kv head): programs for ~4 per SM, each split >= 256 tokens.

    Depends only on shapes (max_context = page_table columns x page size), never on tensor
    values, so a CUDA graph captured for a batch size stays valid for any contents.
    """
    want = math.ceil(4 * _num_sms(device) / max(1, batch * num_kv_heads))
    return max(1, min(want, max_context // 256, 64))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence, q [B, Hq, D], over the paged cache.

    Split-K: each (sequence, kv head) is cut into num_splits pieces attended in parallel,
    then merged. No host syncs; grid and scratch depend on shapes only (CUDA-graph safe).
    A sequence with seq_len 0 gets a zero output. out, if given, is written and returned.
    """
    num_q_heads, num_kv_heads, head_dim = _check(q, k_cache, v_cache)
    g = num_q_heads // num_kv_heads
    batch = q.shape[0]
    page_size = k_cache.shape[1]
    out = _output(q, out)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(
            batch, num_kv_heads, page_table.shape[1] * page_size, q.device
        )
    part_o = torch.empty(
        (batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, part_o, part_lse,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0), num_q_heads, num_splits,
        G=g, PAGE_SIZE=page_size, HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(g)), DOT_PREC=_dot_precision(q.dtype),
        **_decode_config(g, head_dim),
    )  # fmt: skip
    _decode_combine_kernel[(batch, num_q_heads)](
        part_o, part_lse, out, out.stride(0), out.stride(1), num_q_heads, num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
    )  # fmt: skip
    return out
