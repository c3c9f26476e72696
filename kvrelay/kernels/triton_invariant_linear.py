"""y = x @ W^T (+ b) whose every row has the same bits whatever rows share the call: the linear
layers of `--deterministic` on the GPU (issue 22).

cuBLAS picks its kernel, tiles and split-K from M, so a row's dot products are summed in an order
that follows how many rows came with it. Here every M meets one configuration: the weights are
the dot's left operand in BLOCK_N x BLOCK_K tiles, the rows its right operand in BLOCK_M columns
(missing rows masked to zero), accumulating in fp32. K is cut into a number of splits chosen from
N and K alone (`splits_for`: enough programs to keep the GPU's SMs streaming weights at M = 1,
where N / BLOCK_N alone can be 32 programs), each walking its slice of K in BLOCK_K steps; the
splits' fp32 partial sums are then added in split order by one more kernel, and rounded once. A
row's output depends on its own values, the weights and these constants alone. The fixed tiles
cost speed where cuBLAS would pick better ones (large M).

Torch reference: `invariant_linear_reference` (fp32 matmul, rounded once).
"""

from __future__ import annotations

import torch

from kvrelay.kernels.triton_pointwise import _jit, tl, triton

BLOCK_N, BLOCK_K, BLOCK_M = 64, 64, 64  # never chosen by shape: that is the point


def invariant_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


TARGET_PROGRAMS = 256  # ~2 per SM of an H100/H200: a constant, so no machine changes the bits


def splits_for(n: int, k: int) -> tuple[int, int]:
    """(K per split, a multiple of BLOCK_K; splits) from the weight's shape alone."""
    n_tiles, k_steps = -(-n // BLOCK_N), -(-k // BLOCK_K)
    want = max(1, min(-(-TARGET_PROGRAMS // n_tiles), k_steps // 4))
    steps = -(-k_steps // want)
    return steps * BLOCK_K, -(-k_steps // steps)


@_jit(varying=("M",))
def _invariant_linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, PARTIAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # PARTIAL: write this split's fp32 sum to out_ptr[split] ([splits, M, N]), no bias.
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, m_ok = rows < N, ms < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        w = tl.load(
            w_ptr + rows[:, None].to(tl.int64) * stride_wn + ks[None, :],
            row_ok[:, None] & k_ok[None, :],
            0.0,
        )
        x = tl.load(
            x_ptr + ms[None, :].to(tl.int64) * stride_xm + ks[:, None],
            m_ok[None, :] & k_ok[:, None],
            0.0,
        )
        if IEEE:
            acc += tl.dot(w, x, input_precision="ieee")
        else:
            acc += tl.dot(w, x)
    if PARTIAL:
        out = out_ptr + (split * M + ms[None, :]).to(tl.int64) * N + rows[:, None]
        tl.store(out, acc, row_ok[:, None] & m_ok[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, row_ok, 0.0).to(tl.float32)[:, None]
        out = out_ptr + ms[None, :].to(tl.int64) * stride_om + rows[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), row_ok[:, None] & m_ok[None, :])


@_jit(varying=("M",))
def _sum_splits_kernel(
    part_ptr, b_ptr, out_ptr, M, N, SPLITS, stride_om, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    # One output row's BLOCK columns: the splits' partial sums added in split order, in fp32.
    m, pid = tl.program_id(0), tl.program_id(1)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + cols, ok, 0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, ok, 0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), ok)


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """As `invariant_linear_reference`, on the GPU: x [..., K], weight [N, K] (x's dtype)."""
    n, k = weight.shape
    if x.shape[-1] != k or weight.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    b = None if bias is None else bias.contiguous()  # the kernels read it at unit stride
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    k_split, splits = splits_for(n, k)
    part = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M), splits)
    _invariant_linear_kernel[grid](
        x2, w, w if b is None else b, part, m, n, k, k_split,
        x2.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=b is not None, IEEE=x.dtype == torch.float32, PARTIAL=splits > 1,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_M=BLOCK_M, num_warps=4,
    )  # fmt: skip
    if splits > 1:
        _sum_splits_kernel[(m, triton.cdiv(n, 1024))](
            part, w if b is None else b, out, m, n, splits, out.stride(0),
            HAS_BIAS=b is not None, BLOCK=1024, num_warps=4,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)
