"""Triton lightning indexer: index scores of a varlen batch over a paged index-key pool, then
top-k selection by a radix select; CUDA-graph capturable. Oracle:
kvrelay.kernels.indexer_reference.indexer_topk_reference.

Two launches per block of query rows:
1. `_score_kernel`, one program per (query t, span of entries): q[t] [h, d] is loaded once and
   each tile of BLOCK_N entries is gathered through key_rows (fp8 rows dequantized to q's dtype
   first, as the pool reads them), tl.dot(k, qT) [BLOCK_N, h] in fp32 (or tl.dot(q, kT) with
   KEYS_AS_A=False), ReLU, and the w-weighted head sum give fp32 scores, written to a [T, N]
   scratch. Spans at or past n_visible[t] exit without work (causal prefill reads only the
   visible triangle).
2. `_select_kernel`, one program per query row: each visible score becomes a 32-bit
   order-preserving key (+0.0 and -0.0 share one key, every NaN is above +inf, as torch.sort
   orders them; -inf and invisible entries can never be chosen). Radix passes over 8-bit
   digits (RADIX_BITS; tl.histogram) find the K-th largest key `thr` and how many entries
   equal to it to take (`need`), stopping early once every candidate of the picked digit is
   needed; a last pass writes every entry with key > thr and the first `need` entries with
   key == thr, lowest entry first, i.e. exactly the reference's set with its tie rule.

Output order: the chosen entry numbers in ASCENDING entry order, then -1s (the reference orders
them by score). Downstream sparse attention only uses the set. `select="torch"` replaces step 2
by torch.topk over unique int64 keys (score key << 32 | ~entry) and returns the reference's
order exactly.

No host syncs and no data-dependent shapes: grids and scratch depend on T, N and K only.
"""

from __future__ import annotations

import functools

import torch

from kvrelay.kernels.triton_pointwise import _jit, tl, triton

__all__ = ["indexer_scores", "indexer_topk", "topk_select", "topk_select_torch"]

_SCRATCH_ELEMS = 1 << 26  # fp32 score scratch per launch block: at most 256 MiB
_FP8 = torch.float8_e4m3fn


@_jit
def _score_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    ks_ptr,
    rows_ptr,
    seq_ptr,
    nvis_ptr,
    s_ptr,
    n_cols,
    span,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_km,
    stride_rb,
    stride_st,
    H: tl.constexpr,
    H_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KEYS_AS_A: tl.constexpr,
):
    # One program: query row t, entries [start, start + span) clipped to its visible count.
    t = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * span
    n_vis = tl.minimum(tl.load(nvis_ptr + t).to(tl.int32), n_cols)
    if start >= n_vis:
        return
    end = tl.minimum(start + span, n_vis)
    b = tl.load(seq_ptr + t).to(tl.int64)
    h = tl.arange(0, H_PAD)
    h_ok = h < H
    d = tl.arange(0, D)
    # Padded heads have q = 0 and w = 0: their ReLU(0) * 0 adds exactly nothing.
    q = tl.load(
        q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=h_ok[:, None], other=0.0
    )
    w = tl.load(w_ptr + t * stride_wt + h, mask=h_ok, other=0.0)
    rows_base = rows_ptr + b * stride_rb
    out_base = s_ptr + t * stride_st
    if KEYS_AS_A:
        qt = tl.trans(q)  # [D, H_PAD]
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        ok = n < end
        # A -1 row inside the visible range reads row 0, as the reference does.
        row = tl.maximum(tl.load(rows_base + n, mask=ok, other=0).to(tl.int64), 0)
        if FP8:
            sc = tl.load(ks_ptr + row, mask=ok, other=0.0)
        if KEYS_AS_A:
            # [BLOCK_N, D] keys x [D, H] -> [BLOCK_N, H]: the head sum stays inside warps.
            k = tl.load(k_ptr + row[:, None] * stride_km + d[None, :], mask=ok[:, None], other=0.0)
            if FP8:
                k = (k.to(tl.float32) * sc[:, None]).to(q.dtype)
            s = tl.dot(k, qt, input_precision=DOT_PREC)
            s = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL)
            score = tl.sum(s * w[None, :], axis=1)
        else:
            # [H, D] x [D, BLOCK_N] keys -> [H, BLOCK_N].
            kt = tl.load(k_ptr + row[None, :] * stride_km + d[:, None], mask=ok[None, :], other=0.0)
            if FP8:
                kt = (kt.to(tl.float32) * sc[None, :]).to(q.dtype)
            s = tl.dot(q, kt, input_precision=DOT_PREC)
            s = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL)
            score = tl.sum(s * w[:, None], axis=0)
        tl.store(out_base + n, score, mask=ok)


@_jit
def _order_key(s, ok):
    """int64 in [0, 2^32) ordered like the fp32 scores s; 0 where an entry cannot be chosen
    (outside ok, or -inf); -0.0 -> +0.0 and every NaN -> 2^32 - 1 (above +inf)."""
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    signed = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed int order == float order
    key = signed.to(tl.int64) - (-2147483648)
    key = tl.where(s != s, 4294967295, key)
    return tl.where(ok & (s != float("-inf")), key, 0)


@_jit
def _radix_pass(
    row_ptr,
    n,
    prefix,
    rem,
    SHIFT: tl.constexpr,
    FIRST: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One BITS-wide digit (bits SHIFT .. SHIFT + BITS - 1) of the radix select. Candidates:
    choosable keys whose bits above the digit equal prefix's; `rem` of them are still to be
    chosen. Returns the prefix extended by the digit `pick` of the rem-th largest candidate,
    rem minus the candidates above pick, the candidates at pick, and all candidates."""
    bins = tl.arange(0, 1 << BITS)
    hist = tl.zeros([1 << BITS], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        e = start + tl.arange(0, BLOCK)
        ok = e < n
        key = _order_key(tl.load(row_ptr + e, mask=ok, other=0.0), ok)
        m = key > 0
        if not FIRST:
            m = m & ((key >> (SHIFT + BITS)) == (prefix >> (SHIFT + BITS)))
        digit = ((key >> SHIFT) & ((1 << BITS) - 1)).to(tl.int32)
        hist += tl.histogram(digit, 1 << BITS, mask=m)
    ge = tl.cumsum(hist, axis=0, reverse=True)  # candidates whose digit is >= the bin
    pick = tl.max(tl.where(ge >= rem, bins, 0), axis=0)
    at_pick = tl.sum(tl.where(bins == pick, hist, 0), axis=0)
    above = tl.sum(tl.where(bins > pick, hist, 0), axis=0)
    return prefix | (pick.to(tl.int64) << SHIFT), rem - above, at_pick, tl.max(ge, axis=0)


@_jit(varying=("n_cols", "k", "stride_st", "stride_ot"))
def _select_kernel(
    s_ptr,
    nvis_ptr,
    out_ptr,
    n_cols,
    k,
    stride_st,
    stride_ot,
    BLOCK: tl.constexpr,
    K_BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
):
    # One program: one query row. Entries e < min(n_visible, N) are read; the rest never are.
    t = tl.program_id(0).to(tl.int64)
    n = tl.maximum(tl.minimum(tl.load(nvis_ptr + t).to(tl.int32), n_cols), 0)
    row_ptr = s_ptr + t * stride_st
    shift = 32 - RADIX_BITS
    prefix, rem, at_pick, valid = _radix_pass(row_ptr, n, 0, k, shift, True, RADIX_BITS, BLOCK)
    # Later digits only while the picked digit's candidates are not all needed: once they
    # are (usual for continuous scores after 2-3 digits), the keys > prefix (its lower bits
    # are 0) and the `rem` keys == prefix are exactly the keys >= prefix.
    for p in tl.static_range(2, 32 // RADIX_BITS + 1):
        if rem < at_pick:
            prefix, rem, at_pick, _ = _radix_pass(
                row_ptr, n, prefix, rem, 32 - RADIX_BITS * p, False, RADIX_BITS, BLOCK
            )
    # Chosen: keys > thr, and the first `need` keys == thr. At most k choosable entries: all.
    take_all = valid <= k
    thr = tl.where(take_all, 0, prefix)
    need = tl.where(take_all, 0, rem)
    out_row = out_ptr + t * stride_ot
    n_sel = 0
    n_eq = 0
    for start in range(0, n, BLOCK):
        e = start + tl.arange(0, BLOCK)
        ok = e < n
        key = _order_key(tl.load(row_ptr + e, mask=ok, other=0.0), ok)
        eq = ok & (key == thr)
        eq_i = eq.to(tl.int32)
        # Ties at the threshold: the lowest entries first (the reference's stable sort).
        # key > 0: never an entry that cannot be chosen, whatever thr is.
        sel = (key > 0) & ((key > thr) | (eq & (n_eq + tl.cumsum(eq_i, axis=0) - eq_i < need)))
        sel_i = sel.to(tl.int32)
        pos = n_sel + tl.cumsum(sel_i, axis=0) - sel_i
        tl.store(out_row + pos, e.to(tl.int64), mask=sel & (pos < k))  # never past the row
        n_eq += tl.sum(eq_i, axis=0)
        n_sel += tl.sum(sel_i, axis=0)
    for start in range(0, k, K_BLOCK):
        j = start + tl.arange(0, K_BLOCK)
        tl.store(out_row + j, tl.full([K_BLOCK], -1, tl.int64), mask=(j >= n_sel) & (j < k))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter on CPU: pretend to be an H200


def _score_config(heads: int, head_dim: int) -> dict[str, int]:
    """Tile size and launch options of the score kernel: an untuned first choice (keys as the
    MMA's M operand, as DeepGEMM's mqa-logits kernels do); benchmarks/indexer_kernel.py
    --sweep times the alternatives."""
    return {"BLOCK_N": 64, "KEYS_AS_A": True, "num_warps": 4, "num_stages": 3}


def _select_config(n_cols: int, k: int) -> dict[str, int]:
    """Chunk, digit width and launch options of the select kernel (untuned first choice)."""
    block = min(4096, max(256, triton.next_power_of_2(n_cols)))
    return {"BLOCK": block, "RADIX_BITS": 8, "num_warps": max(4, block // 256)}


def _check(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    key_scale: torch.Tensor | None,
    key_rows: torch.Tensor,
    seq_of_token: torch.Tensor,
    n_visible: torch.Tensor,
) -> None:
    if triton is None:
        raise RuntimeError("triton is not installed; use kvrelay.kernels.indexer_reference")
    t_count, h, d = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"index head dim must be a power of two >= 16, got {d}")
    if keys.dim() != 2 or keys.shape[1] != d or keys.stride(1) != 1:
        raise ValueError(f"keys must be [M, {d}] with a contiguous last dim, got {keys.shape}")
    if key_scale is None and keys.dtype != q.dtype:
        raise ValueError(f"keys {keys.dtype} must match q {q.dtype} (or be fp8 with a scale)")
    if key_scale is not None and (keys.dtype != _FP8 or key_scale.dtype != torch.float32):
        raise ValueError("a key_scale needs float8_e4m3fn keys and a float32 scale")
    if w.shape != (t_count, h) or w.dtype != torch.float32:
        raise ValueError(f"w must be [T, h] float32, got {tuple(w.shape)} {w.dtype}")
    if key_rows.dim() != 2 or seq_of_token.shape != (t_count,) or n_visible.shape != (t_count,):
        raise ValueError("key_rows must be [B, N]; seq_of_token and n_visible [T]")


def _launch_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    key_scale: torch.Tensor | None,
    key_rows: torch.Tensor,
    seq_of_token: torch.Tensor,
    n_visible: torch.Tensor,
    scores: torch.Tensor,
    config: dict[str, int] | None,
) -> None:
    """scores[t, e] for e < n_visible[t]; the rest of `scores` is left as it was."""
    t_count, h, d = q.shape
    n_cols = key_rows.shape[1]
    cfg = dict(config or _score_config(h, d))
    tiles_per_program = cfg.pop("TILES", None)
    block_n = cfg["BLOCK_N"]
    tiles = triton.cdiv(n_cols, block_n)
    if tiles_per_program is None:  # about 8 programs per SM over the whole (T, N) rectangle
        tiles_per_program = max(1, min(64, triton.cdiv(t_count * tiles, 8 * _num_sms(q.device))))
    span = block_n * min(tiles, tiles_per_program)
    _score_kernel[(t_count, triton.cdiv(n_cols, span))](
        q, w, keys, key_scale if key_scale is not None else w, key_rows, seq_of_token, n_visible,
        scores, n_cols, span,
        q.stride(0), q.stride(1), w.stride(0), keys.stride(0), key_rows.stride(0), scores.stride(0),
        H=h, H_PAD=max(16, triton.next_power_of_2(h)), D=d,
        FP8=key_scale is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        **cfg,
    )  # fmt: skip


def _launch_select(
    scores: torch.Tensor,
    n_visible: torch.Tensor,
    k: int,
    out: torch.Tensor,
    config: dict[str, int] | None = None,
) -> None:
    """out[t] = the chosen columns of scores[t] (e < n_visible[t]), then -1s."""
    _select_kernel[(scores.shape[0],)](
        scores, n_visible, out, scores.shape[1], k, scores.stride(0), out.stride(0),
        K_BLOCK=min(1024, triton.next_power_of_2(k)),
        **(config or _select_config(scores.shape[1], k)),
    )  # fmt: skip


def _output(t_count: int, k: int, device: torch.device, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(t_count, k, dtype=torch.int64, device=device)
    if out.shape != (t_count, k) or out.dtype != torch.int64 or out.stride(1) != 1:
        raise ValueError(f"out must be [{t_count}, {k}] int64 with a contiguous last dim")
    return out


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def indexer_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    key_scale: torch.Tensor | None,
    key_rows: torch.Tensor,
    seq_of_token: torch.Tensor,
    n_visible: torch.Tensor,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """[T, N] fp32 scores of the score kernel alone, -inf where e >= n_visible[t] (as
    indexer_scores_reference). For tests and benchmarks; indexer_topk does not call it."""
    _check(q, w, keys, key_scale, key_rows, seq_of_token, n_visible)
    q, w, key_rows, seq_of_token, n_visible = map(
        _last_dim_contiguous, (q, w, key_rows, seq_of_token, n_visible)
    )
    if key_scale is not None:
        key_scale = _last_dim_contiguous(key_scale)
    scores = torch.full(
        (q.shape[0], key_rows.shape[1]), float("-inf"), dtype=torch.float32, device=q.device
    )
    if q.shape[0] and key_rows.shape[1]:
        _launch_scores(
            q, w, keys, key_scale, key_rows, seq_of_token, n_visible, scores, config
        )  # fmt: skip
    return scores


def topk_select(
    scores: torch.Tensor, n_visible: torch.Tensor, topk: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[T, K] int64, K = min(topk, N): the reference's set of top-K columns of fp32 scores [T, N]
    among e < n_visible[t] (ties to the lower column; -inf never chosen), in ascending column
    order, then -1s. The Triton radix select of indexer_topk."""
    if triton is None:
        raise RuntimeError("triton is not installed; use topk_select_torch")
    if scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError("scores must be float32 with a contiguous last dim")
    t_count, n_cols = scores.shape
    k = min(topk, n_cols)
    out = _output(t_count, k, scores.device, out)
    if t_count and k > 0:
        _launch_select(scores, _last_dim_contiguous(n_visible), k, out)
    return out


def topk_select_torch(
    scores: torch.Tensor, n_visible: torch.Tensor, topk: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """topk_select by torch.topk on unique int64 keys (score order << 32 | ~column): the same
    set, in the reference's order (score descending, ties lower column first, then -1s)."""
    t_count, n_cols = scores.shape
    k = min(topk, n_cols)
    out = _output(t_count, k, scores.device, out)
    if not (t_count and k > 0):
        return out
    s = torch.where(scores == 0, 0.0, scores.float())  # -0.0 ties +0.0
    bits = s.view(torch.int32).long()
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # in [-2^31, 2^31), float order
    key = torch.where(torch.isnan(s), 2**31 - 1, key)
    cols = torch.arange(n_cols, device=scores.device)
    valid = (cols[None, :] < n_visible.long()[:, None]) & ~torch.isneginf(s)
    key = torch.where(valid, key, -(2**31))
    packed = key * 2**32 + (2**32 - 1 - cols)[None, :]
    top = torch.topk(packed, k, dim=1, sorted=True).values
    chosen = torch.where(top >> 32 == -(2**31), -1, 2**32 - 1 - (top & (2**32 - 1)))
    out.copy_(chosen)
    return out


def indexer_topk(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    key_scale: torch.Tensor | None,
    key_rows: torch.Tensor,
    seq_of_token: torch.Tensor,
    n_visible: torch.Tensor,
    topk: int,
    select: str = "triton",
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """[T, K] int64, K = min(topk, N): per query row the entry numbers (columns of key_rows, not
    pool rows) of its K highest index scores; the set equals indexer_topk_reference's, ties to
    the lower entry, -1 for the places left when fewer than K entries are visible.

    q [T, h, d] bf16/fp16/fp32 (rotated, QAT-rounded); w [T, h] fp32 (scaled by d^-0.5 h^-0.5);
    keys [M, d] of q's dtype, or float8_e4m3fn with key_scale [M] fp32; key_rows [B, N] int32/64
    (columns past a sequence's entries: any valid row or -1; columns >= n_visible[t] are never
    read, a visible -1 reads row 0 like the reference);
    seq_of_token [T], n_visible [T] ints.

    Order: select="triton" (default) returns the chosen entries in ascending entry order, then
    -1s; select="torch" returns the reference's order (score descending). out, if given
    ([T, K] int64), is written and returned. config overrides the score kernel's launch options
    (BLOCK_N, num_warps, num_stages, and TILES per program).
    """
    _check(q, w, keys, key_scale, key_rows, seq_of_token, n_visible)
    if select not in ("triton", "torch"):
        raise ValueError(f"select must be 'triton' or 'torch', got {select!r}")
    t_count, n_cols = q.shape[0], key_rows.shape[1]
    k = min(topk, n_cols)
    out = _output(t_count, k, q.device, out)
    if t_count == 0 or k <= 0:
        return out
    q, w, key_rows, seq_of_token, n_visible = map(
        _last_dim_contiguous, (q, w, key_rows, seq_of_token, n_visible)
    )
    if key_scale is not None:
        key_scale = _last_dim_contiguous(key_scale)
    step = max(1, _SCRATCH_ELEMS // n_cols)
    scores = torch.empty(min(step, t_count), n_cols, dtype=torch.float32, device=q.device)
    for b in range(0, t_count, step):
        e = min(b + step, t_count)
        blk = scores[: e - b]
        _launch_scores(
            q[b:e], w[b:e], keys, key_scale, key_rows, seq_of_token[b:e], n_visible[b:e], blk,
            config,
        )  # fmt: skip
        if select == "triton":
            _launch_select(blk, n_visible[b:e], k, out[b:e])
        else:
            topk_select_torch(blk, n_visible[b:e], k, out[b:e])
    return out
