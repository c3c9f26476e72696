"""y = x @ W^T for FP8 block-scaled weights (e4m3 with one power-of-two scale per 128 x 128
block, DeepSeek's checkpoint format) read as they are stored: each tile of W is converted to
the activation dtype in registers (e4m3 -> bf16 is exact) and its dot product multiplied by the
tile's scale, so a decode step reads one byte per weight instead of two.

The weights are the dot's left operand (decode batches are far smaller than the MMA's 64 rows),
and small grids split K over more programs whose fp32 partials a second kernel sums in a fixed
order (deterministic: no atomics). `groups` > 1 is the block-diagonal projection of DeepSeek-V4's
attention output: group g of x meets rows g*N..(g+1)*N of W.

Torch reference: `fp8_linear_reference` (dequantize, then matmul in fp32).
"""

from __future__ import annotations

import torch

from kvrelay.kernels.triton_pointwise import _jit, tl, triton
from kvrelay.quant.fp8_block import DEFAULT_WEIGHT_BLOCK, dequantize_fp8_block

SCALE_BLOCK = DEFAULT_WEIGHT_BLOCK[0]  # 128 rows x 128 columns per scale
BLOCK_K = 128
TARGET_PROGRAMS = 264  # two per SM on an H200: enough loads in flight for a GEMV


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int = 1
) -> torch.Tensor:
    """x [M, groups*K] (grouped: [M, groups, K]), weight [groups*N, K] e4m3, scale float32
    [ceil(groups*N/128), ceil(K/128)] -> [M, groups*N] (grouped: [M, groups, N]) in x's dtype."""
    w = dequantize_fp8_block(weight, scale, dtype=torch.float32)
    xf = x.float().reshape(x.shape[0], groups, -1)
    y = torch.einsum("mgk,gnk->mgn", xf, w.view(groups, -1, w.shape[1]))
    return y.reshape(*x.shape[:-1], -1).to(x.dtype) if x.dim() == 2 else y.to(x.dtype)


@_jit(varying=("M",))
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_om, stride_sn, k_split, splits,
    OUT_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n, pid_m, pid_z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g, split = pid_z // splits, pid_z % splits
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # within the group
    wrows = (g * N + rows).to(tl.int64)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, m_ok = rows < N, ms < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_lo = split * k_split
    for i in range(0, k_split, BLOCK_K):  # the last split may run past K: masked
        k0 = k_lo + i
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_ptr + wrows[:, None] * K + ks[None, :], row_ok[:, None] & k_ok[None, :], 0.0)
        x = tl.load(
            x_ptr + ms[None, :].to(tl.int64) * stride_xm + g * K + ks[:, None],
            m_ok[None, :] & k_ok[:, None],
            0.0,
        )
        s = tl.load(s_ptr + (wrows // 128) * stride_sn + k0 // 128, row_ok, 0.0)
        if IEEE:
            part = tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(w.to(x.dtype), x)
        acc += part * s[:, None]
    out = ms[None, :].to(tl.int64) * stride_om + g * N + rows[:, None]
    mask = row_ok[:, None] & m_ok[None, :]
    if OUT_SPLITS:  # fp32 partials [splits, M, groups*N]
        tl.store(out_ptr + split * M * stride_om + out, acc, mask)
    else:
        tl.store(out_ptr + out, acc.to(out_ptr.dtype.element_ty), mask)


@_jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, splits, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):  # a fixed order: the same sum for the same shapes
        acc += tl.load(part_ptr + s * numel + offs, mask, 0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask)


def _tiles(m: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): decode batches sit in one narrow column of M; prefill uses squarer
    tiles (the dot is then compute-bound)."""
    if m <= 16:
        return 16, 64
    if m <= 64:
        return 64, 64
    return 128, 128


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int = 1
) -> torch.Tensor:
    """As `fp8_linear_reference`, on the GPU. weight: [groups*N, K] float8_e4m3fn, scale:
    float32 [ceil(groups*N/128), ceil(K/128)]."""
    grouped = x.dim() == 3
    m = x.shape[0]
    x2 = x.reshape(m, -1)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    k = weight.shape[1]
    n = weight.shape[0] // groups
    if x2.shape[1] != groups * k:
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    bm, bn = _tiles(m)
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm) * groups
    k_blocks = triton.cdiv(k, BLOCK_K)
    splits = max(1, min(k_blocks, TARGET_PROGRAMS // tiles)) if m <= 64 else 1
    k_split = triton.cdiv(k_blocks, splits) * BLOCK_K
    splits = triton.cdiv(k, k_split)
    out = torch.empty(m, groups * n, dtype=x.dtype, device=x.device)
    dest = out if splits == 1 else torch.empty(splits, m, groups * n, device=x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), groups * splits)
    _fp8_linear_kernel[grid](
        x2, weight.view(torch.uint8).view(torch.float8_e4m3fn), scale, dest, m, n, k,
        x2.stride(0), groups * n, scale.stride(0), k_split, splits,
        OUT_SPLITS=splits > 1, IEEE=x.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, num_warps=4,
        num_stages=2 if x.dtype == torch.float32 and bm > 64 else 4,  # fp32 tiles: shared memory
    )  # fmt: skip
    if splits > 1:
        numel = out.numel()
        _sum_splits_kernel[(triton.cdiv(numel, 1024),)](dest, out, numel, splits, BLOCK=1024)
    return out.view(m, groups, n) if grouped else out
