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


@_jit
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
    w = tl.load(
        fn_ptr + r[None, :].to(tl.int64) * (N * D) + (j * D + d)[:, None],
        mask=(r < R)[None, :] & (d < D)[:, None],
        other=0.0,
    )  # [N * BD, RP]
    acc = tl.dot(v, w, input_precision="ieee")  # [BT, RP]
    tm = t < T
    tl.store(part_ptr + (t[:, None] * n_slices + s) * RP + r[None, :], acc, mask=tm[:, None])
    tl.store(sq_ptr + t * n_slices + s, tl.sum(v * v, axis=1), mask=tm)


@_jit
def _hc_finish_kernel(
    part_ptr, sq_ptr, x_ptr, scale_ptr, base_ptr, norm_w_ptr, h_ptr, post_ptr, comb_ptr,
    S, D, hc_eps, mix_eps, rms_eps,
    N: tl.constexpr, ITERS: tl.constexpr, RP: tl.constexpr, SP: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SP)
    sm = s < S
    prow = (t * S + s) * RP  # [SP]
    sq = tl.sum(tl.load(sq_ptr + t * S + s, mask=sm, other=0.0), axis=0)
    rms = tl.rsqrt(sq / (N * D) + mix_eps)
    j = tl.arange(0, N)
    m2 = sm[:, None]
    pre = tl.sum(tl.load(part_ptr + prow[:, None] + j[None, :], mask=m2, other=0.0), axis=0)
    pre = tl.sigmoid(pre * rms * tl.load(scale_ptr) + tl.load(base_ptr + j)) + hc_eps
    post = tl.sum(tl.load(part_ptr + prow[:, None] + N + j[None, :], mask=m2, other=0.0), axis=0)
    post = 2 * tl.sigmoid(post * rms * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + j))
    tl.store(post_ptr + t * N + j, post)
    ab = j[:, None] * N + j[None, :]  # comb[a, b] = mix[2N + a * N + b]
    c = tl.load(part_ptr + prow[:, None, None] + 2 * N + ab[None, :, :], mask=sm[:, None, None],
                other=0.0)  # fmt: skip
    c = tl.sum(c, axis=0) * rms * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + ab)
    c = tl.exp(c - tl.max(c, axis=1)[:, None])
    c = c / tl.sum(c, axis=1)[:, None] + hc_eps  # row softmax + eps
    c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
        c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
    tl.store(comb_ptr + t * N * N + ab, c)
    # collapse: h = sum_i pre_i X_i in the streams' dtype, then the sub-layer's RMSNorm
    cols = tl.arange(0, BLOCK)
    cm = cols < D
    xs = tl.load(x_ptr + (t * N + j[:, None]) * D + cols[None, :], mask=cm[None, :], other=0.0)
    h = tl.sum(pre[:, None] * xs.to(tl.float32), axis=0).to(h_ptr.dtype.element_ty)
    h = h.to(tl.float32)
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
    out, p_post, p_comb = (
        (x.contiguous() for x in pending) if pending is not None else (streams, post, comb)
    )
    _hc_mix_kernel[(triton.cdiv(t, BLOCK_T), slices)](
        streams, out, p_post, p_comb, new, fn.contiguous(), part, sq, t, d,
        MERGE=pending is not None, N=n, R=r, RP=rp, BT=BLOCK_T, BD=BLOCK_D, num_warps=4,
    )  # fmt: skip
    block = triton.next_power_of_2(d)
    _hc_finish_kernel[(t,)](
        part, sq, new, scale.float().contiguous(), base.float().contiguous(),
        norm_weight.float().contiguous(), h, post, comb, slices, d, hc_eps, mix_eps, rms_eps,
        N=n, ITERS=iters, RP=rp, SP=triton.next_power_of_2(slices), BLOCK=block,
        num_warps=max(1, min(8, block // 256)),
    )  # fmt: skip
    return new, h, post, comb


@_jit
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
