"""y = x @ W^T (+ b) whose every row has the same bits whatever rows share the call: the linear
layers of `--deterministic` on the GPU (issue 22; not wired into the mode yet).

cuBLAS picks its kernel, tiles and split-K from M, so a row's dot products are summed in an order
that follows how many rows came with it. Here every M meets one configuration: the weights are
the dot's left operand in BLOCK_N x BLOCK_K tiles, the rows its right operand in BLOCK_M columns
(missing rows masked to zero), and one program walks K from 0 to K in BLOCK_K steps (no split-K),
accumulating in fp32 and rounding once. A row's output then depends on its own values, the
weights and these constants alone. The fixed tiles cost speed where cuBLAS would pick better
ones (large M); decode rows are read once per BLOCK_M.

Torch reference: `invariant_linear_reference` (fp32 matmul, rounded once).
"""

from __future__ import annotations

import torch

from kvrelay.kernels.triton_pointwise import _jit, tl, triton

BLOCK_N, BLOCK_K, BLOCK_M = 64, 64, 16  # never chosen by shape: that is the point


def invariant_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@_jit(varying=("M",))
def _invariant_linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, m_ok = rows < N, ms < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
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
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, row_ok, 0.0).to(tl.float32)[:, None]
    out = out_ptr + ms[None, :].to(tl.int64) * stride_om + rows[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), row_ok[:, None] & m_ok[None, :])


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
    b = None if bias is None else bias.contiguous()  # the kernel reads it at unit stride
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M))
        _invariant_linear_kernel[grid](
            x2, w, w if b is None else b, out, m, n, k,
            x2.stride(0), w.stride(0), out.stride(0),
            HAS_BIAS=b is not None, IEEE=x.dtype == torch.float32,
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_M=BLOCK_M, num_warps=4,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)
