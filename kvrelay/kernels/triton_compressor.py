"""DeepSeek-V4's compressor window pooling in one Triton launch: for every closing row, gather
the r (or 2r, overlapping) rows of its window from this step's projections, the state slot's
pending rows or its previous half, and pool them (softmax of the scores over the window, per
channel, weighting the kv rows). The torch reference and the exact gathering rules are
`models/deepseek_v4/pooled_compressor.pool_windows_reference`; it took ~40 small torch ops
per compressor, ~1000 launches per decode step of dsv4-mini.

Grid (closers, d / BD): one program per closing row and channel block, the window [W, BD] in
registers (W = 2r overlapping, r otherwise; r a power of two). Overlapping compressors also
write the closing window's first halves (channels :d of its r rows), which the caller leaves
in the prev state after every program has read the old one.
"""

from __future__ import annotations

import torch

from kvrelay.kernels.triton_pointwise import _jit, tl, triton


@_jit
def _gather(
    step_ptr, pend_ptr, prev_ptr, tok, flat, in_step, pend, valid_q, choff, ch, chm, LD, d,
    OVERLAP: tl.constexpr,
):  # fmt: skip
    # [W, BD] rows of one window from their three homes (see the module docstring).
    c2 = chm[None, :]
    cols = choff[:, None] + ch[None, :]
    v = tl.load(step_ptr + tok[:, None] * LD + cols, mask=in_step[:, None] & c2, other=0.0)
    from_pend = (~in_step & pend)[:, None] & c2
    v_pend = tl.load(pend_ptr + flat[:, None] * LD + cols, mask=from_pend, other=0.0)
    v = tl.where(in_step[:, None], v.to(tl.float32), v_pend.to(tl.float32))
    if OVERLAP:
        from_prev = (~in_step & ~pend & valid_q)[:, None] & c2
        v_prev = tl.load(prev_ptr + flat[:, None] * d + ch[None, :], mask=from_prev, other=0.0)
        v = tl.where((in_step | pend)[:, None], v, v_prev.to(tl.float32))
    return v


@_jit(varying=("t_n",))
def _pool_windows_kernel(
    kv_ptr, score_ptr, pk_ptr, ps_ptr, prev_kv_ptr, prev_score_ptr,
    rows_ptr, pos_ptr, seq_ptr, start_ptr, slots_ptr, base_ptr,
    out_ptr, first_kv_ptr, first_score_ptr,
    t_n, d, LD,
    R: tl.constexpr, OVERLAP: tl.constexpr, W: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    ch = tl.program_id(1) * BD + tl.arange(0, BD)
    chm = ch < d
    row = tl.load(rows_ptr + c)
    s = tl.load(seq_ptr + row)
    start = tl.load(start_ptr + s)
    slot = tl.load(slots_ptr + s)
    base = tl.load(base_ptr + s)
    wstart = tl.load(pos_ptr + row) + 1 - R  # first position of the closing window
    j = tl.arange(0, W)
    if OVERLAP:  # rows 0..r-1: the previous window's first half; r..2r-1: this one's second
        is_prev = j < R
        q = tl.where(is_prev, wstart - R + j, wstart + j - R)
        choff = tl.where(is_prev, 0, d)
        pend = (q >= start // R * R) | ~is_prev  # rows of this window not in the step: pending
        valid_q = q >= 0  # the first window has no previous one
    else:
        q = wstart + j
        choff = j * 0
        pend = j >= 0
        valid_q = pend
    in_step = q >= start
    tok = tl.minimum(tl.maximum(base + q - start, 0), t_n - 1)
    # a slot row is position % 2R (two windows: models/deepseek_v4/cache_pool.py); >= 0 for
    # the first window's q < 0
    flat = slot * 2 * R + ((q % (2 * R)) + 2 * R) % (2 * R)
    kv = _gather(
        kv_ptr, pk_ptr, prev_kv_ptr, tok, flat, in_step, pend, valid_q, choff, ch, chm, LD, d,
        OVERLAP,
    )  # fmt: skip
    sc = _gather(
        score_ptr, ps_ptr, prev_score_ptr, tok, flat, in_step, pend, valid_q, choff, ch, chm,
        LD, d, OVERLAP,
    )  # fmt: skip
    if OVERLAP:
        kv = tl.where(valid_q[:, None], kv, 0.0)
        sc = tl.where(valid_q[:, None], sc, float("-inf"))
    mx = tl.max(sc, axis=0)
    e = tl.exp(sc - mx[None, :])
    pooled = tl.sum(e * kv, axis=0) / tl.sum(e, axis=0)
    tl.store(out_ptr + c.to(tl.int64) * d + ch, pooled, mask=chm)
    if OVERLAP:  # this window's first halves, for the caller's prev-state update
        jr = tl.arange(0, R)
        q1 = wstart + jr
        in1 = q1 >= start
        tok1 = tl.minimum(tl.maximum(base + q1 - start, 0), t_n - 1)
        flat1 = slot * 2 * R + ((q1 % (2 * R)) + 2 * R) % (2 * R)  # q1 < 0: padding only
        yes = jr >= 0
        zero = jr * 0
        kv1 = _gather(
            kv_ptr, pk_ptr, prev_kv_ptr, tok1, flat1, in1, yes, yes, zero, ch, chm, LD, d, False
        )
        sc1 = _gather(
            score_ptr, ps_ptr, prev_score_ptr, tok1, flat1, in1, yes, yes, zero, ch, chm, LD, d,
            False,
        )  # fmt: skip
        dst = (c.to(tl.int64) * R + jr)[:, None] * d + ch[None, :]
        tl.store(first_kv_ptr + dst, kv1, mask=chm[None, :])
        tl.store(first_score_ptr + dst, sc1, mask=chm[None, :])


def pool_windows(kv, score, pending_kv, pending_score, prev_kv, prev_score, meta, cl, r, d):
    """Same contract as `pool_windows_reference` (pooled and first halves in fp32)."""
    if r & (r - 1):
        raise ValueError(f"compress ratio {r} is not a power of two")
    overlap = prev_kv is not None
    c_n = cl.rows.shape[0]
    dev = kv.device
    out = torch.empty(c_n, d, dtype=torch.float32, device=dev)
    first = None
    if overlap:
        first = (
            torch.empty(c_n, r, d, dtype=torch.float32, device=dev),
            torch.empty(c_n, r, d, dtype=torch.float32, device=dev),
        )
    if c_n == 0:
        return out, first
    kv, score = kv.contiguous(), score.contiguous()
    w = 2 * r if overlap else r
    bd = min(triton.next_power_of_2(d), 32 if w >= 64 else 64)
    prev = (prev_kv, prev_score) if overlap else (kv, score)  # never read without overlap
    firsts = first if overlap else (out, out)
    _pool_windows_kernel[(c_n, triton.cdiv(d, bd))](
        kv, score, pending_kv, pending_score, *prev,
        cl.rows, meta.positions, meta.seq, meta.chunk_start, meta.slots, meta.tok_base,
        out, *firsts,
        kv.shape[0], d, kv.shape[1],
        R=r, OVERLAP=overlap, W=w, BD=bd, num_warps=4,
    )  # fmt: skip
    return out, first
