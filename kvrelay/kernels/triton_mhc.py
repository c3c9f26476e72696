"""mHC on the fast path. `hc_pre`, for decode-sized steps: a hyper-connection's pre side in two
launches: (merge the previous sub-layer into the streams,) mix, gates with Sinkhorn, collapse,
and the sub-layer's RMSNorm. The torch form (`HyperConnection.forward` + the norm, and
`merge_streams` of the sub-layer before) is ~9 launches per sub-layer; a batch-1 decode step of
dsv4-mini runs 40 of them. `hc_gates`, for long prefill chunks (where the compiled mix and
collapse are faster: `hc_pre`'s per-token programs cost ~1 ms per sub-layer at 4096 tokens):
the gates alone in one launch, BLOCK_T tokens' n x n matrices per program through every
Sinkhorn iteration.

Kernel 1 (`_hc_mix_kernel`, a grid of token blocks x hidden-dim slices): optionally writes the
merged streams X'_j = post_j * out + sum_i comb[i, j] X_i of the previous sub-layer, and writes
each slice's partial dot products of the flattened streams with `fn` and its partial sum of
squares. The slices are fixed by the hidden size (BLOCK_D), never by the token count, so every
token's sums are added in the same order whatever the batch (batch invariant).
Kernel 2 (`_hc_finish_kernel`, one program per token): adds the partials in slice order, then
mix = dot * rsqrt(mean(X^2) + eps), the gates (sigmoid pre/post, row softmax + Sinkhorn on comb),
h = sum_i pre_i X_i rounded to the streams' dtype, and RMSNorm(h) * weight rounded once.
"""

from __future__ import annotations

import torch

from kvrelay.kernels.triton_pointwise import _jit, tl, triton

BLOCK_T = 16  # tokens per program of kernel 1 (tl.dot needs 16 rows)
BLOCK_D = 32  # hidden-dim slice per program of kernel 1: n * BLOCK_D flat columns
GATES_BLOCK_T = 32
PRE_MAX_TOKENS = 512  # hc_pre up to this many tokens per step, hc_gates beyond (measured)


@_jit(varying=("T",))
def _hc_mix_kernel(
    x_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, fn_ptr, part_ptr, sq_ptr, T, D,
    MERGE: tl.constexpr, N: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(1)
    n_slices = tl.num_programs(1)
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    kk = tl.arange(0, N * BD)  # flat column j * D + d of this slice, j = kk // BD
    j = kk // BD
    d = s * BD + kk % BD
    m = (t < T)[:, None] & (d < D)[None, :]
    row = t[:, None] * N
    if MERGE:
        o = tl.load(out_ptr + t[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        mixed = tl.zeros([BT, N * BD], dtype=tl.float32)
        for i in tl.static_range(N):  # sum_i comb[i, j] X_i, i in order (as merge_streams)
            xi = tl.load(x_ptr + (row + i) * D + d[None, :], mask=m, other=0.0).to(tl.float32)
            ci = tl.load(comb_ptr + row * N + i * N + j[None, :], mask=m, other=0.0)
            mixed = mixed + ci * xi
        p = tl.load(post_ptr + row + j[None, :], mask=m, other=0.0)
        v = (p * o + mixed).to(new_ptr.dtype.element_ty)
        tl.store(new_ptr + (row + j[None, :]) * D + d[None, :], v, mask=m)
        v = v.to(tl.float32)
    else:
        v = tl.load(x_ptr + (row + j[None, :]) * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.arange(0, RP)
    # fn's rows as they lie in memory (each slice of a row contiguous, coalesced loads), [RP, N * BD]
    w = tl.load(
        fn_ptr + r[:, None].to(tl.int64) * (N * D) + (j * D + d)[None, :],
        mask=(r < R)[:, None] & (d < D)[None, :],
        other=0.0,
    )
    acc = tl.dot(v, tl.trans(w), input_precision="ieee")  # [BT, RP]
    tm = t < T
    tl.store(part_ptr + (t[:, None] * n_slices + s) * RP + r[None, :], acc, mask=tm[:, None])
    tl.store(sq_ptr + t * n_slices + s, tl.sum(v * v, axis=1), mask=tm)


@_jit
def _norm4(a, b, c, d, eps):
    """Four scalars over (their sum + eps): one row or column of the 4 x 4 Sinkhorn."""
    z = a + b + c + d + eps
    return a / z, b / z, c / z, d / z


@_jit
def _softmax4(a, b, c, d, eps):
    """Softmax of four scalars, + eps: one row of the comb logits."""
    m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = tl.exp(a - m), tl.exp(b - m), tl.exp(c - m), tl.exp(d - m)
    z = a + b + c + d
    return a / z + eps, b / z + eps, c / z + eps, d / z + eps


@_jit
def _hc_finish_kernel(
    part_ptr, sq_ptr, gates_ptr, x_ptr, scale_ptr, base_ptr, norm_w_ptr, h_ptr, post_ptr,
    comb_ptr, S, D, hc_eps, mix_eps, rms_eps,
    ITERS: tl.constexpr, RP: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SP)
    sm = s < S
    r = tl.arange(0, RP)
    sq = tl.sum(tl.load(sq_ptr + t * S + s, mask=sm, other=0.0), axis=0)
    rms = tl.rsqrt(sq / (4 * D) + mix_eps)
    part = tl.load(part_ptr + (t * S + s)[:, None] * RP + r[None, :], mask=sm[:, None], other=0.0)
    grp = tl.where(r < 4, 0, tl.where(r < 8, 1, 2))  # pre | post | comb logits
    rm = r < 24
    g = tl.sum(part, axis=0) * rms * tl.load(scale_ptr + grp) + tl.load(base_ptr + r, mask=rm)
    g = tl.where(grp == 0, tl.sigmoid(g) + hc_eps, tl.where(grp == 1, 2 * tl.sigmoid(g), g))
    tl.store(post_ptr + t * 4 + r - 4, g, mask=grp == 1)
    # The 4 x 4 Sinkhorn in scalars, which every thread computes alike: as tensors, each of its
    # 40 row and column sums was a reduction across warps through shared memory.
    tl.store(gates_ptr + t * RP + r, g, mask=rm)
    tl.debug_barrier()  # the gates written above are read back as scalars below
    row = gates_ptr + t * RP
    c00, c01, c02, c03 = _softmax4(tl.load(row + 8), tl.load(row + 9), tl.load(row + 10),
                                   tl.load(row + 11), hc_eps)  # fmt: skip
    c10, c11, c12, c13 = _softmax4(tl.load(row + 12), tl.load(row + 13), tl.load(row + 14),
                                   tl.load(row + 15), hc_eps)  # fmt: skip
    c20, c21, c22, c23 = _softmax4(tl.load(row + 16), tl.load(row + 17), tl.load(row + 18),
                                   tl.load(row + 19), hc_eps)  # fmt: skip
    c30, c31, c32, c33 = _softmax4(tl.load(row + 20), tl.load(row + 21), tl.load(row + 22),
                                   tl.load(row + 23), hc_eps)  # fmt: skip
    c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, hc_eps)  # the first pass: columns only
    c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, hc_eps)
    c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, hc_eps)
    c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, hc_eps)
    for _ in range(ITERS - 1):
        c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, hc_eps)
        c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, hc_eps)
        c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, hc_eps)
        c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, hc_eps)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, hc_eps)
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, hc_eps)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, hc_eps)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, hc_eps)
    ab = r - 8
    comb = tl.where(ab == 0, c00, tl.where(ab == 1, c01, tl.where(ab == 2, c02, c03)))
    comb = tl.where(ab == 4, c10, tl.where(ab == 5, c11, tl.where(ab == 6, c12, comb)))
    comb = tl.where(ab == 7, c13, tl.where(ab == 8, c20, tl.where(ab == 9, c21, comb)))
    comb = tl.where(ab == 10, c22, tl.where(ab == 11, c23, tl.where(ab == 12, c30, comb)))
    comb = tl.where(ab == 13, c31, tl.where(ab == 14, c32, tl.where(ab == 15, c33, comb)))
    tl.store(comb_ptr + t * 16 + ab, comb, mask=(ab >= 0) & (ab < 16))
    # collapse: h = sum_i pre_i X_i in the streams' dtype, then the sub-layer's RMSNorm
    cols = tl.arange(0, BLOCK)
    cm = cols < D
    x = x_ptr + t * 4 * D + cols
    h = tl.load(row) * tl.load(x, mask=cm, other=0.0).to(tl.float32)
    h += tl.load(row + 1) * tl.load(x + D, mask=cm, other=0.0).to(tl.float32)
    h += tl.load(row + 2) * tl.load(x + 2 * D, mask=cm, other=0.0).to(tl.float32)
    h += tl.load(row + 3) * tl.load(x + 3 * D, mask=cm, other=0.0).to(tl.float32)
    h = h.to(h_ptr.dtype.element_ty).to(tl.float32)
    y = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + rms_eps)
    y = y * tl.load(norm_w_ptr + cols, mask=cm, other=0.0)
    tl.store(h_ptr + t * D + cols, y.to(h_ptr.dtype.element_ty), mask=cm)


def hc_pre(
    streams: torch.Tensor,
    pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    iters: int,
    hc_eps: float,
    mix_eps: float,
    norm_weight: torch.Tensor,
    rms_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, D] (bf16 or fp32; n a power of 2), `pending` (out [T, D], post [T, n],
    comb [T, n, n]) of the previous sub-layer or None -> (the merged streams, normed sub-layer
    input [T, D] in the streams' dtype, post [T, n] fp32, comb [T, n, n] fp32). fn: [(2+n)*n,
    n*D] fp32 (HyperConnection.fn); the norm weight fp32."""
    if streams.dtype == torch.float64:
        raise ValueError("hc_pre: float64 runs the torch reference")
    t, n, d = streams.shape
    if n != 4:
        raise ValueError(f"hc_pre: {n} streams (the kernel's Sinkhorn is written for 4)")
    streams = streams.contiguous()
    dev, f32 = streams.device, torch.float32
    new = torch.empty_like(streams) if pending is not None else streams
    h = torch.empty(t, d, dtype=streams.dtype, device=dev)
    post = torch.empty(t, n, dtype=f32, device=dev)
    comb = torch.empty(t, n, n, dtype=f32, device=dev)
    if t == 0:
        return new, h, post, comb
    r = (2 + n) * n
    rp, slices = max(16, triton.next_power_of_2(r)), triton.cdiv(d, BLOCK_D)  # tl.dot: N >= 16
    part = torch.empty(t, slices, rp, dtype=f32, device=dev)
    sq = torch.empty(t, slices, dtype=f32, device=dev)
    gates = torch.empty(t, rp, dtype=f32, device=dev)  # pre | post | comb logits, per token
    out, p_post, p_comb = (
        (x.contiguous() for x in pending) if pending is not None else (streams, post, comb)
    )
    _hc_mix_kernel[(triton.cdiv(t, BLOCK_T), slices)](
        streams, out, p_post, p_comb, new, fn.contiguous(), part, sq, t, d,
        MERGE=pending is not None, N=n, R=r, RP=rp, BT=BLOCK_T, BD=BLOCK_D, num_warps=4,
    )  # fmt: skip
    block = triton.next_power_of_2(d)
    _hc_finish_kernel[(t,)](
        part, sq, gates, new, scale.float().contiguous(), base.float().contiguous(),
        norm_weight.float().contiguous(), h, post, comb, slices, d, hc_eps, mix_eps, rms_eps,
        ITERS=iters, RP=rp, SP=triton.next_power_of_2(slices), BLOCK=block,
        num_warps=max(1, min(8, block // 256)),
    )  # fmt: skip
    return new, h, post, comb


@_jit(varying=("T",))
def _hc_gates_kernel(
    mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, hc_eps,
    N: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tm = t < T
    width = (2 + N) * N
    j = tl.arange(0, N)
    row = t.to(tl.int64)[:, None] * width
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    m2 = tm[:, None]
    pre = tl.load(mix_ptr + row + j[None, :], mask=m2, other=0.0) * s0 + tl.load(base_ptr + j)
    pre = tl.sigmoid(pre) + hc_eps
    post = tl.load(mix_ptr + row + N + j[None, :], mask=m2, other=0.0) * s1
    post = 2 * tl.sigmoid(post + tl.load(base_ptr + N + j))
    out = t.to(tl.int64)[:, None] * N + j[None, :]
    tl.store(pre_ptr + out, pre, mask=m2)
    tl.store(post_ptr + out, post, mask=m2)
    # comb[t, a, b] = mix[t, 2N + a*N + b] * s2 + base[2N + a*N + b]
    ab = j[:, None] * N + j[None, :]
    m3 = tm[:, None, None]
    c = tl.load(mix_ptr + row[:, :, None] + 2 * N + ab[None, :, :], mask=m3, other=0.0)
    c = c * s2 + tl.load(base_ptr + 2 * N + ab)[None, :, :]
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = c / tl.sum(c, axis=2)[:, :, None] + hc_eps  # row softmax + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    tl.store(comb_ptr + t.to(tl.int64)[:, None, None] * N * N + ab[None, :, :], c, mask=m3)


def hc_gates(
    mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix [T, (2+n)*n] fp32 -> (pre [T, n], post [T, n], comb [T, n, n]) fp32; n a power of 2."""
    t = mix.shape[0]
    mix = mix.contiguous()
    pre = torch.empty(t, n, dtype=torch.float32, device=mix.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=mix.device)
    grid = (triton.cdiv(t, GATES_BLOCK_T),)
    _hc_gates_kernel[grid](
        mix, scale.float().contiguous(), base.float().contiguous(), pre, post, comb, t, hc_eps,
        N=n, ITERS=iters, BLOCK=GATES_BLOCK_T,
    )  # fmt: skip
    return pre, post, comb
