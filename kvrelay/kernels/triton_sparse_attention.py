"""Triton sparse MQA with per-head sinks (DeepSeek-V4 attention) over two gathered K = V sources.

Semantics match kvrelay.models.deepseek_v4.sparse_attention (`sparse_mqa_reference`, or
`sparse_attention` over the concatenated sources). Every query row lists its own entries: row
numbers into the sliding-window pool (source a) and into the compressed-entry pool (source b),
-1 = no entry. One D-vector per entry is both key and value and serves every head, so a program
takes all heads of one query row (up to 64) and loads each gathered row once for all of them:
logits[H, N] = q[H, D] @ kv[N, D]^T, acc[H, D] += p[H, N] @ kv[N, D].

Split-K: the row's entry list (a then b) is cut into chunks of whole tiles, one program per
(query row, chunk, head block), each an online softmax; a combine kernel merges the partial
(max, sum, acc) and adds the sink exp(sink_h) to the denominator. With one chunk per row the
split kernel finishes the row itself. Grid and scratch depend on shapes only (no host syncs,
CUDA-graph safe). Option DV_SPLIT=2: two programs (one warpgroup each) share a row and
chunk, each owning half of the output columns; both compute the full logits.
"""

from __future__ import annotations

import functools
import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the module imports, the kernels refuse to run
    triton = None
    tl = None

__all__ = ["sparse_mqa", "sparse_mqa_splits"]

_LOG2E = 1.4426950408889634


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _attend_entries(
    acc,
    l_i,
    m_i,
    q,
    q_other,
    col0,
    kv_a_ptr,
    idx_a_row_ptr,
    kv_b_ptr,
    idx_b_row_ptr,
    stride_kva,
    stride_kvb,
    len_a,
    start,
    end,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DV_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGNED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Online softmax over positions [start, end) of the row's entry list: position n < len_a
    is entry idx_a[n] of source a, position n >= len_a is entry idx_b[n - len_a] of source b.
    One loop over both sources: no pipeline drain between them, tiles may straddle.

    acc holds output columns [col0, col0 + BLOCK_DV) and q the same columns of the query.
    With DV_SPLIT == 2, q_other holds the other half of the query's columns and the logits
    add the products of both halves."""
    d = col0 + tl.arange(0, BLOCK_DV)
    d_other = (BLOCK_DV - col0) + tl.arange(0, BLOCK_DV)  # the other half (DV_SPLIT == 2)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        in_a = n < len_a
        in_b = (n >= len_a) & (n < end)
        ia = tl.load(idx_a_row_ptr + n, mask=in_a & (n < end), other=-1).to(tl.int64)
        ib = tl.load(idx_b_row_ptr + (n - len_a), mask=in_b, other=-1).to(tl.int64)
        valid = (ia >= 0) | (ib >= 0)
        rows = tl.where(in_a, kv_a_ptr + ia * stride_kva, kv_b_ptr + ib * stride_kvb)
        if ALIGNED:
            # Both pools have 16-byte aligned rows (checked on the host). Unless len_a is a
            # multiple of 16 the select hides that, and the gather would load 2 bytes at a time.
            rows = tl.multiple_of(rows, 16)
        if BLOCK_DV * DV_SPLIT == HEAD_DIM:
            kv = tl.load(rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        else:
            kv_ok = valid[:, None] & (d[None, :] < HEAD_DIM)
            kv = tl.load(rows[:, None] + d[None, :], mask=kv_ok, other=0.0)
        # K = V: one load feeds both products, for every head.
        s = tl.dot(q, tl.trans(kv), input_precision=DOT_PREC)
        if DV_SPLIT == 2:
            kv_o_ok = valid[:, None] & (d_other[None, :] < HEAD_DIM)
            kv_o = tl.load(rows[:, None] + d_other[None, :], mask=kv_o_ok, other=0.0)
            s = tl.dot(q_other, tl.trans(kv_o), s, input_precision=DOT_PREC)
        s = s * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@_jit
def _sparse_split_kernel(
    q_ptr,
    kv_a_ptr,
    idx_a_ptr,
    kv_b_ptr,
    idx_b_ptr,
    sinks_ptr,
    out_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kva,
    stride_ia,
    stride_kvb,
    stride_ib,
    stride_ot,
    stride_oh,
    num_heads,
    len_a,
    len_b,
    chunk,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DV_SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    ALIGNED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # One program: all BLOCK_H heads of head block hb of query row t, output columns
    # [col0, col0 + BLOCK_DV), over the entries at positions [split * chunk, (split + 1) *
    # chunk) of the row's list (source a, then b). The DV_SPLIT programs of one row and split
    # are adjacent in launch order: the second finds the gathered rows in L2.
    t = (tl.program_id(0) // DV_SPLIT).to(tl.int64)
    col0 = (tl.program_id(0) % DV_SPLIT) * BLOCK_DV
    split = tl.program_id(1)
    hb = tl.program_id(2)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    d = col0 + tl.arange(0, BLOCK_DV)
    d_ok = d < HEAD_DIM
    q_row = q_ptr + (t * stride_qt + h * stride_qh)[:, None]
    q = tl.load(q_row + d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if DV_SPLIT == 2:
        d_other = (BLOCK_DV - col0) + tl.arange(0, BLOCK_DV)
        q_ok = h_ok[:, None] & (d_other[None, :] < HEAD_DIM)
        q_other = tl.load(q_row + d_other[None, :], mask=q_ok, other=0.0)
    else:
        q_other = q  # unused

    # Finite start: a split without any valid entry keeps l = 0 and never makes NaN.
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    acc, l_i, m_i = _attend_entries(
        acc, l_i, m_i, q, q_other, col0,
        kv_a_ptr, idx_a_ptr + t * stride_ia, kv_b_ptr, idx_b_ptr + t * stride_ib,
        stride_kva, stride_kvb, len_a, split * chunk,
        tl.minimum(split * chunk + chunk, len_a + len_b), qk_scale,
        HEAD_DIM, BLOCK_DV, DV_SPLIT, BLOCK_N, ALIGNED, DOT_PREC,
    )  # fmt: skip

    mask = h_ok[:, None] & d_ok[None, :]
    if DIRECT:
        # The only split of its row: add the sink and write the output.
        sink = tl.load(sinks_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m_i, sink)
        w = tl.exp2(m_i - m)
        out = acc * (w / (l_i * w + tl.exp2(sink - m)))[:, None]
        o_off = t * stride_ot + h * stride_oh
        tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials [T, splits, H, (D)]: unnormalized acc, running max (log2 units) and sum.
        row = (t * num_splits + split) * num_heads + h
        first = h_ok & (col0 == 0)  # every column block has the same max and sum
        tl.store(part_m_ptr + row, m_i, mask=first)
        tl.store(part_l_ptr + row, l_i, mask=first)
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=mask)


@_jit
def _sparse_combine_kernel(
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    sinks_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # One program: BLOCK_H heads of query row t; merges the row's splits and adds the sink.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    d = tl.arange(0, BLOCK_D)
    mask = h_ok[:, None] & (d[None, :] < HEAD_DIM)
    s = tl.arange(0, BLOCK_S)
    ms_off = (t * num_splits + s[:, None]) * num_heads + h[None, :]  # [BLOCK_S, BLOCK_H]
    ms_ok = (s[:, None] < num_splits) & h_ok[None, :]
    m_s = tl.load(part_m_ptr + ms_off, mask=ms_ok, other=-1.0e30)
    sink = tl.load(sinks_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m = tl.maximum(tl.max(m_s, 0), sink)
    l_s = tl.load(part_l_ptr + ms_off, mask=ms_ok, other=0.0)
    denom = tl.sum(l_s * tl.exp2(m_s - m[None, :]), 0) + tl.exp2(sink - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for i in range(0, num_splits):
        row = (t * num_splits + i) * num_heads + h
        w = tl.exp2(tl.load(part_m_ptr + row, mask=h_ok, other=-1.0e30) - m)
        o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        acc += w[:, None] * o
    out = acc / denom[:, None]
    o_off = t * stride_ot + h * stride_oh
    tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter on CPU: pretend to be an H200


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 dots would silently run in tf32; "ieee" keeps fp32 inputs exact to ~1e-6.
    return "ieee" if dtype == torch.float32 else "tf32"


def _split_config(dtype: torch.dtype, num_heads: int, head_dim: int) -> dict[str, int]:
    """Tile sizes and launch options of the split kernel.

    bf16/fp16, H=64, D=512 (the real model): q [64, 512] stays in shared memory (64 KB), the
    [64, 512] fp32 accumulator is 128 registers a thread over 8 warps (each warpgroup owns
    256 columns of the PV product), kv tiles of 32 rows (32 KB) double-buffered: 131 KB of
    shared memory, 255 registers, no spills (ptxas for sm_90; scripts/dev_sparse_attention_
    interpret.py --sm90). BLOCK_N=64 gives wider QK instructions but spills.
    fp32 (tests, oracle runs): "ieee" dots run on CUDA cores; 16 heads a program keeps the
    [16, 512] fp32 q and accumulator small (kv rows are re-read per head block, from L2).

    Measured on the H200 (benchmarks/sparse_attention_kernel.py): ~3.5-4.3 us per 32-entry
    tile per SM, far above its bytes. Triton gives the logits product of a chained dot all 8
    warps along M, so with 64 heads both warpgroups compute the same [64, 32] logits with
    m64n16 instructions. DV_SPLIT=2 with num_warps=4 (one warpgroup a program, half the
    output columns each) makes them m64n{BLOCK_N} without that duplication inside a program
    (ptxas: no spills at BLOCK_N=32); the benchmark's --sweep compares the two.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        block_h, block_n = 16, 16
    else:
        block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
        block_n = 32 if block_d <= 512 else 16
    return {
        "BLOCK_D": block_d,
        "BLOCK_H": block_h,
        "BLOCK_N": block_n,
        "DV_SPLIT": 1,
        "num_warps": 8 if block_h * block_d >= 16 * 512 else 4,
        "num_stages": 3,
    }


# Split-count cost model, in units of "one SM streams one gathered bf16 entry" (~30 ns on an
# H200): a program costs its entries plus _PROGRAM_COST (loading q, pipeline fill, epilogue);
# splitting a row adds an [H, D] fp32 partial written and read back by the combine (4 H
# entries' worth of bytes, spread over all SMs) and _COMBINE_COST for the second launch.
_PROGRAM_COST = 64
_COMBINE_COST = 64
_MAX_SPLITS = 64


def sparse_mqa_splits(
    num_rows: int, num_entries: int, num_heads: int, device: torch.device, block_n: int = 32
) -> tuple[int, int]:
    """(entries per split, splits per row) for num_rows query rows of num_entries entries each.

    Picks the split count with the least modelled time: waves of programs over the SMs
    (one program of the H=64 kernel per SM) times the per-program work, plus the partials'
    traffic when a row is split. Depends only on shapes, never on tensor values, so a
    captured CUDA graph stays valid for any contents.
    """
    if num_entries <= 0:
        return block_n, 1
    sms = _num_sms(device)
    head_blocks = math.ceil(num_heads / 64)
    partial = 4 * min(num_heads, 64)  # [H, D] fp32 written + read, in bf16 entries of D
    best = None
    for want in range(1, min(_MAX_SPLITS, math.ceil(num_entries / block_n)) + 1):
        chunk, splits = _chunk_for(num_entries, want, block_n)
        programs = num_rows * splits * head_blocks
        cost = math.ceil(programs / sms) * (chunk + _PROGRAM_COST)
        if splits > 1:
            cost += programs * partial / sms + _COMBINE_COST
        if best is None or cost < best[0]:
            best = (cost, chunk, splits)
    return best[1], best[2]


def _chunk_for(num_entries: int, splits: int, block_n: int) -> tuple[int, int]:
    """Whole tiles per split, and the number of splits that covers num_entries with them."""
    chunk = block_n * math.ceil(math.ceil(num_entries / splits) / block_n)
    return chunk, max(1, math.ceil(num_entries / chunk))


def _aligned(kv: torch.Tensor) -> bool:
    """Every row starts on a 16-byte boundary (lets the gather load 16 bytes at a time)."""
    return kv.data_ptr() % 16 == 0 and (kv.stride(0) * kv.element_size()) % 16 == 0


def _check_source(name: str, kv: torch.Tensor, idx: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if kv.dim() != 2 or kv.shape[1] != q.shape[2]:
        raise ValueError(f"kv_{name} must be [M, {q.shape[2]}], got {tuple(kv.shape)}")
    if kv.stride(1) != 1:
        raise ValueError(f"kv_{name} needs a unit stride in its last dim")
    if kv.dtype != q.dtype or kv.device != q.device:
        raise ValueError(f"kv_{name} is {kv.dtype} on {kv.device}, q is {q.dtype} on {q.device}")
    if idx.dim() != 2 or idx.shape[0] != q.shape[0]:
        raise ValueError(f"idx_{name} must be [{q.shape[0]}, K], got {tuple(idx.shape)}")
    if idx.dtype not in (torch.int32, torch.int64) or idx.device != q.device:
        raise ValueError(f"idx_{name} must be int32/int64 on {q.device}, got {idx.dtype}")
    return idx if idx.stride(1) == 1 or idx.shape[1] <= 1 else idx.contiguous()


def sparse_mqa(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    idx_a: torch.Tensor,
    kv_b: torch.Tensor | None,
    idx_b: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Sparse MQA with sinks: q [T, H, D] over rows idx_a [T, Ka] of kv_a [Ma, D] and rows
    idx_b [T, Kb] of kv_b [Mb, D] (-1 = no entry; kv_b / idx_b may both be None).

    Equal to sparse_attention(q, cat(kv_a, kv_b), cat(idx_a, idx_b shifted by Ma), sinks,
    scale): softmax over the listed entries in fp32, exp(sink_h) added to the denominator
    only; a row without entries gives 0. kv rows need a unit stride in the last dim (any row
    stride, e.g. a flattened view of a paged pool). num_splits (per row, default from shapes
    only), out (written in place) and config (tile overrides, for benchmarks: BLOCK_N,
    num_warps, num_stages) are optional. Returns [T, H, D] in q.dtype.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use the torch reference instead")
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q must be [T, H, D] with a unit last stride, got {tuple(q.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    if (kv_b is None) != (idx_b is None):
        raise ValueError("kv_b and idx_b must both be given or both be None")
    num_rows, num_heads, head_dim = q.shape
    idx_a = _check_source("a", kv_a, idx_a, q)
    if kv_b is None:
        kv_b, idx_b, len_b = kv_a, idx_a, 0  # never read: its ranges are empty
    else:
        idx_b = _check_source("b", kv_b, idx_b, q)
        len_b = idx_b.shape[1]
    len_a = idx_a.shape[1]
    if sinks.shape != (num_heads,) or sinks.device != q.device:
        raise ValueError(f"sinks must be [{num_heads}] on {q.device}, got {tuple(sinks.shape)}")
    sinks = sinks.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a unit last stride")
    if num_rows == 0 or num_heads == 0:
        return out

    cfg = {**_split_config(q.dtype, num_heads, head_dim), **(config or {})}
    block_d, block_h, block_n = cfg.pop("BLOCK_D"), cfg["BLOCK_H"], cfg["BLOCK_N"]
    dv_split = cfg["DV_SPLIT"]
    if dv_split not in (1, 2):
        raise ValueError(f"DV_SPLIT must be 1 or 2, got {dv_split}")
    if num_splits is None:
        chunk, splits = sparse_mqa_splits(num_rows, len_a + len_b, num_heads, q.device, block_n)
    else:
        chunk, splits = _chunk_for(max(1, len_a + len_b), max(1, num_splits), block_n)
    direct = splits == 1
    if direct:
        part_o = part_m = part_l = out  # unused
    else:
        f32 = {"dtype": torch.float32, "device": q.device}
        part_o = torch.empty((num_rows, splits, num_heads, head_dim), **f32)
        part_m = torch.empty((num_rows, splits, num_heads), **f32)
        part_l = torch.empty((num_rows, splits, num_heads), **f32)
    grid = (num_rows * dv_split, splits, triton.cdiv(num_heads, block_h))
    _sparse_split_kernel[grid](
        q, kv_a, idx_a, kv_b, idx_b, sinks, out, part_o, part_m, part_l,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        kv_a.stride(0), idx_a.stride(0), kv_b.stride(0), idx_b.stride(0),
        out.stride(0), out.stride(1),
        num_heads, len_a, len_b, chunk, splits,
        HEAD_DIM=head_dim, BLOCK_DV=block_d // dv_split,
        DIRECT=direct, ALIGNED=_aligned(kv_a) and _aligned(kv_b),
        DOT_PREC=_dot_precision(q.dtype), **cfg,
    )  # fmt: skip
    if not direct:
        comb_h = min(triton.next_power_of_2(num_heads), max(1, 4096 // block_d))
        _sparse_combine_kernel[(num_rows, triton.cdiv(num_heads, comb_h))](
            part_o, part_m, part_l, sinks, out, out.stride(0), out.stride(1),
            num_heads, splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=comb_h,
            BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
        )  # fmt: skip
    return out
