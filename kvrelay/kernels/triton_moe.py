"""Fused MoE for DeepSeek-V4's routed experts in Triton, CUDA-graph capturable (no host syncs,
every shape fixed by T, k and E), reading the experts as they lie in memory: dense (bf16/fp32)
or packed NVFP4 or MXFP4, dequantized in registers inside the GEMM (no bf16 copy of any expert).

Semantics are those of the torch reference `Experts.forward` (models/deepseek_v4/experts.py):
per (token, slot) gate_up = x @ W_gu^T (rounded to x.dtype), act = silu(min(gate, limit)) *
clamp(up, -limit, limit) * routing weight (rounded to x.dtype), y = act @ W_down^T (rounded to
x.dtype), out[t] = fp32 sum of y over the k slots, in slot order (deterministic).

Four launches (the grouping takes ~15 small torch ops instead past GROUP_MAX_ASSIGN
assignments, i.e. in prefill):
1. grouping (`_group_kernel`, one program): the assignments sorted by expert into blocks of
   BLOCK_M rows (layout in moe_grouping.py, whose torch code is its reference);
2. `_gate_up_kernel`, grid (max_blocks, I / BLOCK_N): one block of one expert against BLOCK_N
   gate rows and the matching up rows, SwiGLU and routing weight in the epilogue, act written
   in block order [max_blocks * BLOCK_M, I]; programs past the last used block exit at once;
3. `_down_kernel`, grid (max_blocks, H / BLOCK_N): act rows of a block against the down rows,
   y written per assignment [T*k, H] in x.dtype;
4. the sum of y over k in fp32 (torch; deterministic, no atomics).
Both GEMMs: activations [BLOCK_M, BLOCK_K] (x rows gathered by token, or act rows of the block)
are the dot's left operand, weights [BLOCK_N, BLOCK_K] its right one (SWAP_AB flips them). The
compiler pipelines the activation, weight (and dense) tile loads through shared memory; the
small NVFP4 scale tile is loaded one iteration ahead by hand. With K a multiple of BLOCK_K
(every real shape) no load is masked along K, so all stay vectorized.
NVFP4 weight tiles: bytes [BLOCK_N, BLOCK_K/2] (element 2j = low nibble of byte j) are decoded
in registers: both nibbles of a byte become two fp16 in one 32-bit word by two multiplies and
two masks (`_e2m1_pair`, exact: e2m1 * 2^-14, fp16 keeps the one subnormal), each scale of the
[BLOCK_N, BLOCK_K/16] e4m3 tile is converted once and spread over its 8 bytes; the even and
odd elements (low and high nibbles) stay apart and meet the even and odd columns of x in two
dots (a sum over K in any order is the same sum; no interleaving shuffle per weight).
NVFP4 with bf16 x (the serving route): weight = e2m1 * scale * 2^-7, exact in bf16 (at most 5
significant bits), built from four packed bytes at a time in a few integer instructions and one
bf16x2 multiply (`_E2M1_BF16_ASM`); the global scale * 2^7 is applied to the fp32 accumulator.
The reference instead rounds e2m1 * scale * global to bf16 per weight, so these weights are
closer to the true product (about half the reference's error against an fp64 oracle) and about
5e-3 from the reference itself. fp32 x (and MXFP4): weight = e2m1 * (scale * global scale) in
fp32, rounded once to x.dtype, as the reference computes it up to one fp32 ulp: outputs match
the reference up to summation order. fp16_mma route (NVFP4 with bf16 x, opt-in): the same exact
weights in fp16, x and act as fp16 (saturated at +-65504, exact inside that range).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvrelay.kernels.moe_grouping import Grouping, group_by_expert, max_blocks
from kvrelay.kernels.triton_pointwise import _jit, tl, triton

if TYPE_CHECKING:
    from kvrelay.models.deepseek_v4.experts import Experts

GROUP_MAX_ASSIGN = 2048  # above this many assignments the torch grouping runs instead
GROUP_CHUNK = 64  # most assignments per step of the grouping kernel (fewer for small batches)
ACT_BLOCK_N = 512  # columns per program of the split route's activation kernel
SUM_BLOCK_N = 1024  # and of its sum over the k slots


@dataclass(frozen=True)
class MoeConfig:
    """Tile shape of both GEMMs (block_m is also the grouping's block size)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128  # weights along K per step (NVFP4: block_k / 2 bytes, a multiple of 32)
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False  # weights as the dot's left operand (see the module docstring)
    fp16_mma: bool = False  # NVFP4 with bf16 x: fp16 MMA operands (see the module docstring)
    split_k: int = 1  # > 1: each GEMM's K in this many programs (see `fused_experts`)


def default_config(n_assign: int, num_experts: int) -> MoeConfig:
    """Decode (a few rows per expert): BLOCK_M 16, BLOCK_N 64, each routed expert's weights read
    once per step; with bf16 x the decoded weights then reach the MMA in registers (no
    shared-memory round trip), where SWAP_AB (weights as the dot's left operand) and BLOCK_N 32
    go through shared memory and shuffles. Prefill: bigger blocks, so that each weight tile is
    decoded once for more rows. Picked by the H200 sweep (benchmarks/moe_kernel.py --sweep):
    T=1 67 us, T=8 313, T=64 1312, T=256 1760 (NVFP4, bf16 x; 91 / 476 / 2020 / 2658 with the
    fp32-scaled decode before the packed bf16 one)."""
    per_expert = n_assign / max(num_experts, 1)
    if per_expert <= 12:
        return MoeConfig(16, 64, 128, 4, 3)
    if per_expert <= 32:
        return MoeConfig(32, 32, 128, 4, 3)
    if per_expert <= 64:
        return MoeConfig(64, 64, 64, 4, 3)
    return MoeConfig(128, 128, 64, 8, 3)


# `--deterministic` on the GPU: one config at every token count (the decode one), so a token's
# dot products run in the same tiles whichever rows share its expert's blocks.
INVARIANT_CONFIG = MoeConfig(16, 64, 128, 4, 3)


# -- grouping ------------------------------------------------------------------------------


@_jit(varying=("n", "n_blocks"))
def _group_kernel(
    ids_ptr, tok_ptr, blk_e_ptr, blk_rows_ptr, n, n_blocks,
    E: tl.constexpr, E_P2: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr,
):  # fmt: skip
    # One program. Pass 1 counts assignments per expert, pass 2 places each at its expert's
    # next free row (running count + rank among equal ids earlier in the chunk), pass 3 labels
    # the blocks. Chunks of CH assignments against all E_P2 experts as one-hot tiles.
    er = tl.arange(0, E_P2)
    cr = tl.arange(0, CH)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for c0 in range(0, n, CH):
        a = c0 + cr
        ids = tl.load(ids_ptr + a, mask=a < n, other=E_P2).to(tl.int32)
        counts += tl.sum((ids[:, None] == er[None, :]).to(tl.int32), axis=0)
    blocks = (counts + BM - 1) // BM
    blk_end = tl.cumsum(blocks, axis=0)
    blk_start = blk_end - blocks
    running = blk_start * BM
    earlier = cr[None, :] < cr[:, None]  # [i, j]: j before i
    for c0 in range(0, n, CH):
        a = c0 + cr
        amask = a < n
        ids = tl.load(ids_ptr + a, mask=amask, other=E_P2).to(tl.int32)
        onehot = ids[:, None] == er[None, :]
        base = tl.sum(tl.where(onehot, running[None, :], 0), axis=1)
        rank = tl.sum(((ids[:, None] == ids[None, :]) & earlier).to(tl.int32), axis=1)
        tl.store(tok_ptr + base + rank, a, mask=amask)
        running += tl.sum(onehot.to(tl.int32), axis=0)
    for b0 in range(0, n_blocks, CH):
        b = b0 + cr
        e = tl.sum((blk_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        hit = er[None, :] == e[:, None]
        cnt = tl.sum(tl.where(hit, counts[None, :], 0), axis=1)
        st = tl.sum(tl.where(hit, blk_start[None, :], 0), axis=1)
        rows = tl.minimum(cnt - (b - st) * BM, BM)
        used = e < E
        bmask = b < n_blocks
        tl.store(blk_e_ptr + b, tl.where(used, e, -1), mask=bmask)
        tl.store(blk_rows_ptr + b, tl.where(used, rows, 0), mask=bmask)


def group_assignments(idx: torch.Tensor, num_experts: int, block_m: int) -> Grouping:
    """`group_by_expert` in one Triton launch for up to GROUP_MAX_ASSIGN assignments (the
    torch code past that, and without a GPU or interpreter)."""
    n = idx.numel()
    if triton is None or n > GROUP_MAX_ASSIGN or n == 0:
        return group_by_expert(idx, num_experts, block_m)
    nb = max_blocks(n, num_experts, block_m)
    chunk = min(GROUP_CHUNK, max(16, triton.next_power_of_2(max(n, nb))))
    dev = idx.device
    token_ids = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    block_rows = torch.empty(nb, dtype=torch.int32, device=dev)
    _group_kernel[(1,)](
        idx.reshape(-1), token_ids, block_expert, block_rows, n, nb,
        E=num_experts, E_P2=triton.next_power_of_2(num_experts), BM=block_m, CH=chunk,
        num_warps=8 if chunk > 32 else 4,
    )  # fmt: skip
    return Grouping(token_ids, block_expert, block_rows)


# -- GEMMs ---------------------------------------------------------------------------------


@_jit
def _e2m1_pair(b):
    # b: int32 bytes -> (low nibble, high nibble) as float16 e2m1 * 2^-14, exactly. Each
    # nibble's code (sign bit 3, exponent bits 2-1, mantissa bit 0) goes to an fp16's sign and
    # low exponent/top mantissa bits; that fp16 is e2m1 * 2^-14 (code 1 lands on the subnormal
    # 2^-15, which fp16 keeps). Both fp16 are built in one 32-bit word by two multiplies (each
    # places two non-overlapping shifted copies of the byte) and two masks; the caller folds
    # 2^14 into the scale.
    u = b.to(tl.uint32)
    w = ((u * 0x00200200) & 0x0E000E00) | ((u * 0x01001000) & 0x80008000)
    lo = w.to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo, hi


# Four packed bytes (8 e2m1 codes) -> their low nibbles and their high nibbles as bf16 pairs,
# each e2m1 * 2^-126 exactly (code bits 2-0 to bf16 bits 8-6, the sign to bit 15: code 1 is the
# subnormal 2^-127), times the bf16 scale pair of those bytes: e2m1 * scale * 2^-7, exact (at
# most 5 significant bits, never below 2^-17). A PRMT spreads two bytes into the two 16-bit
# lanes of a register; per plane, one mask keeps the nibble, one multiply places both of its
# shifted copies (magnitude and sign; they cannot overlap, so no carries), one mask keeps the
# bf16 bits, and one bf16x2 multiply scales: ~2.3 instructions per weight (fp32 route: ~8).
_E2M1_BF16_PTX = """
{
.reg .b32 x, a;
prmt.b32 x, $4, 0, 0x4140;
and.b32 a, x, 0x000F000F;  mul.lo.u32 a, a, 0x1040;  and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $0, a, $5;
and.b32 a, x, 0x00F000F0;  mul.lo.u32 a, a, 0x104;  and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $2, a, $5;
prmt.b32 x, $4, 0, 0x4342;
and.b32 a, x, 0x000F000F;  mul.lo.u32 a, a, 0x1040;  and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $1, a, $6;
and.b32 a, x, 0x00F000F0;  mul.lo.u32 a, a, 0x104;  and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $3, a, $6;
}
"""
# a global a Triton function may read must be a constexpr (plain text on CPU installs)
_E2M1_BF16_ASM = tl.constexpr(_E2M1_BF16_PTX) if tl is not None else _E2M1_BF16_PTX


@_jit
def _e2m1_bf16_scaled(raw, sc):
    # raw: packed bytes [R, C] (uint8), sc: bf16 [R, C] scale * 2^119 of each byte ->
    # (low nibbles, high nibbles) as bf16 [R, C], e2m1 * scale * 2^-7 (see _E2M1_BF16_ASM).
    return tl.inline_asm_elementwise(
        _E2M1_BF16_ASM, "=r,=r,=r,=r,r,r,r", [raw, sc],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
    )  # fmt: skip


@_jit
def _scale_tile(
    s_ptr, rows, rmask, k0, K, stride_sn,
    BK: tl.constexpr, EVEN_K: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    # The raw scale bytes [R, BK/GROUP] of rows `rows` (e4m3 per 16 inputs for NVFP4, e8m0 per
    # 32 for MXFP4), elements k0 .. k0+BK (none past K). Loaded
    # one iteration ahead by the caller: a tile this small (2-4 bytes a thread) is not
    # pipelined by the compiler, and its latency would stall every iteration.
    gi = k0 // GROUP + tl.arange(0, BK // GROUP)
    if EVEN_K:
        m = rmask[:, None] & (k0 < K)
    else:
        m = rmask[:, None] & (gi < K // GROUP)[None, :]
    return tl.load(s_ptr + rows[:, None] * stride_sn + gi[None, :], mask=m, other=0)


@_jit
def _fp4_halves(
    p_ptr, s, gs, rows, rmask, k0, K, stride_pn,
    R: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, EVEN_K: tl.constexpr, MX: tl.constexpr,
):  # fmt: skip
    # Weight rows `rows` [R], elements k0 .. k0+BK -> (even elements, odd elements), each
    # [R, BK/2] in DT: the low and high nibbles of the bytes, never interleaved back into
    # element order (the caller splits x the same way and runs two dots; an interleave costs
    # a register shuffle per weight). Bytes [R, BK/2] load as a plain 2-D tile (pipelined by
    # the compiler); each scale of s [R, BK/16] is converted once and spread over its 8 bytes
    # (both nibbles of a byte share it). DT float16 (the fp16-MMA route): e2m1 * e4m3 scale *
    # 2^-7, exact in fp16 (as small as 2^-17: a subnormal only for the tiniest scales), the
    # caller multiplies the accumulator by gs * 2^7. DT bfloat16: the same exact e2m1 * e4m3
    # scale * 2^-7 in bf16 (`_e2m1_bf16_scaled`, gs * 2^7 again on the accumulator). DT
    # float32: e2m1 * (e4m3 scale * gs) in fp32, as the reference. MX (MXFP4): s holds e8m0 bytes, one per 32 inputs (16 bytes),
    # no global scale: the factor 2^(byte - 127) * 2^14 is built from its exponent bits
    # (exact; byte 255 is NaN as in the reference, bytes above 240 (scales > 2^113) saturate
    # to inf, no real checkpoint has them); the fp16 route is NVFP4-only.
    BKH: tl.constexpr = BK // 2
    if MX:
        sb = s.to(tl.int32)
        bits = tl.where(sb == 255, 0x7FC00000, tl.where(sb > 240, 0x7F800000, (sb + 14) << 23))
        scm = bits.to(tl.float32, bitcast=True)
        scm = tl.reshape(tl.broadcast_to(scm[:, :, None], [R, BK // 32, 16]), [R, BKH])
    G: tl.constexpr = BK // 16
    kb = k0 // 2 + tl.arange(0, BKH)
    if EVEN_K:  # no mask along K: loads stay vectorized
        m = rmask[:, None]
    else:
        m = rmask[:, None] & (kb < K // 2)[None, :]
    raw = tl.load(p_ptr + rows[:, None] * stride_pn + kb[None, :], mask=m, other=0)
    # if/else rather than early returns: the compiler still builds the code after a return
    # in a constexpr branch, and the NVFP4 shapes do not fit an MXFP4 scale tile.
    if MX:
        lo, hi = _e2m1_pair(raw.to(tl.int32))
        w_even = (lo.to(tl.float32) * scm).to(DT)
        w_odd = (hi.to(tl.float32) * scm).to(DT)
    else:
        s8 = s.to(tl.float8e4nv, bitcast=True)
        if DT == tl.bfloat16:
            # e4m3 scale * 2^119 in bf16 (exact: 4 significant bits, <= 448 * 2^119 < 2^128)
            sc = (s8.to(tl.float32) * 6.646139978924579e35).to(tl.bfloat16)
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [R, G, 8]), [R, BKH])
            w_even, w_odd = _e2m1_bf16_scaled(raw, sc)
        elif DT == tl.float16:
            lo, hi = _e2m1_pair(raw.to(tl.int32))
            sc = s8.to(tl.float16) * 128.0  # <= 448 * 128 < 65504: exact
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [R, G, 8]), [R, BKH])
            w_even = lo * sc
            w_odd = hi * sc
        else:
            lo, hi = _e2m1_pair(raw.to(tl.int32))
            sc = s8.to(tl.float32) * (gs * 16384.0)
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [R, G, 8]), [R, BKH])
            w_even = (lo.to(tl.float32) * sc).to(DT)
            w_odd = (hi.to(tl.float32) * sc).to(DT)
    return w_even, w_odd


@_jit
def _weight_dot(
    acc, xk, w_ptr, s, gs, rows, rmask, k0, K, stride_wn,
    R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, FP4: tl.constexpr,
    EVEN_K: tl.constexpr, SWAP: tl.constexpr, PREC: tl.constexpr, MX: tl.constexpr,
):  # fmt: skip
    # acc += xk [BM, BK] against weight rows `rows` [R], elements k0 .. k0+BK, dense or NVFP4
    # (s: its raw scale tile from `_scale_tile`; unused when dense).
    if FP4:
        w_even, w_odd = _fp4_halves(
            w_ptr, s, gs, rows, rmask, k0, K, stride_wn, R, BK, DT, EVEN_K, MX
        )
        x_even, x_odd = tl.split(tl.reshape(xk, [BM, BK // 2, 2]))
        acc = _mma(acc, w_even, x_even, SWAP, PREC)
        acc = _mma(acc, w_odd, x_odd, SWAP, PREC)
    else:
        offs_k = k0 + tl.arange(0, BK)
        m = rmask[:, None] if EVEN_K else rmask[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=m, other=0.0)
        acc = _mma(acc, w.to(DT), xk, SWAP, PREC)
    return acc


@_jit
def _mma(acc, w, xk, SWAP: tl.constexpr, PREC: tl.constexpr):
    # w [BN, BK] weights, xk [BM, BK] activations; acc [BN, BM] (SWAP) or [BM, BN].
    if SWAP:
        acc = tl.dot(w, tl.trans(xk), acc, input_precision=PREC)
    else:
        acc = tl.dot(xk, tl.trans(w), acc, input_precision=PREC)
    return acc


@_jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, rw_ptr, tok_ptr, blk_e_ptr, blk_rows_ptr, act_ptr,
    K, N_INTER, top_k, limit,
    stride_x, stride_we, stride_wn, stride_se, stride_sn,
    FP4: tl.constexpr, HAS_LIMIT: tl.constexpr, SWAP: tl.constexpr, PREC: tl.constexpr,
    MX: tl.constexpr, GROUP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
    ODT: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    # x_ptr: the MMA operand (x, or its fp16 copy on the fp16-MMA route); ODT: x's own dtype,
    # to which gate and up are rounded as F.linear rounds them; act_ptr: x.dtype or fp16.
    # SPLITS > 1: program_id(2) takes 1/SPLITS of K, and act_ptr is the fp32 partials
    # [SPLITS, blocks * BM, 2 * N_INTER] (gate | up, scaled) that `_act_kernel` finishes.
    b = tl.program_id(0)
    n_rows = tl.load(blk_rows_ptr + b)
    if n_rows == 0:  # past the last used block
        return
    e = tl.load(blk_e_ptr + b).to(tl.int64)
    DT = x_ptr.dtype.element_ty
    r = tl.arange(0, BM)
    rmask = r < n_rows
    a = tl.load(tok_ptr + b * BM + r, mask=rmask, other=0)
    x_rows = x_ptr + (a // top_k).to(tl.int64)[:, None] * stride_x
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = offs_n < N_INTER
    gate_rows = offs_n.to(tl.int64)
    up_rows = gate_rows + N_INTER
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    gs_g = 1.0
    gs_u = 1.0
    if FP4 and not MX:
        gs_g = tl.load(gs_ptr + 2 * e)
        gs_u = tl.load(gs_ptr + 2 * e + 1)
    if SWAP:
        acc_g = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    k_lo, k_hi = _k_range(K, BK, SPLITS)
    sg_next = 0
    su_next = 0
    if FP4:
        sg_next = _scale_tile(s_e, gate_rows, nmask, k_lo, K, stride_sn, BK, EVEN_K, GROUP)
        su_next = _scale_tile(s_e, up_rows, nmask, k_lo, K, stride_sn, BK, EVEN_K, GROUP)
    for k0 in range(k_lo, k_hi, BK):
        sg = sg_next
        su = su_next
        if FP4:
            sg_next = _scale_tile(s_e, gate_rows, nmask, k0 + BK, K, stride_sn, BK, EVEN_K, GROUP)
            su_next = _scale_tile(s_e, up_rows, nmask, k0 + BK, K, stride_sn, BK, EVEN_K, GROUP)
        offs_k = k0 + tl.arange(0, BK)
        xm = rmask[:, None] if EVEN_K else rmask[:, None] & (offs_k < K)[None, :]
        xk = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0)
        acc_g = _weight_dot(
            acc_g, xk, w_e, sg, gs_g, gate_rows, nmask, k0, K, stride_wn,
            BN, BM, BK, DT, FP4, EVEN_K, SWAP, PREC, MX,
        )  # fmt: skip
        acc_u = _weight_dot(
            acc_u, xk, w_e, su, gs_u, up_rows, nmask, k0, K, stride_wn,
            BN, BM, BK, DT, FP4, EVEN_K, SWAP, PREC, MX,
        )  # fmt: skip
    if FP4 and not MX and DT != tl.float32:  # exact-weight routes leave gs * 2^7 to acc
        acc_g = acc_g * (gs_g * 128.0)
        acc_u = acc_u * (gs_u * 128.0)
    rows = b * BM + r
    if SPLITS > 1:  # the partial sums, for _act_kernel
        part = act_ptr + tl.program_id(2) * (tl.num_programs(0) * BM * 2 * N_INTER)
        _store_rows(part, rows, 2 * N_INTER, offs_n, acc_g, rmask, nmask, SWAP)
        _store_rows(part + N_INTER, rows, 2 * N_INTER, offs_n, acc_u, rmask, nmask, SWAP)
    else:
        rw = tl.load(rw_ptr + a, mask=rmask, other=0.0)
        if SWAP:
            act = _activation(acc_g, acc_u, rw[None, :], limit, HAS_LIMIT, ODT, act_ptr)
        else:
            act = _activation(acc_g, acc_u, rw[:, None], limit, HAS_LIMIT, ODT, act_ptr)
        _store_rows(act_ptr, rows, N_INTER, offs_n, act, rmask, nmask, SWAP)


@_jit
def _k_range(K, BK: tl.constexpr, SPLITS: tl.constexpr):
    """This program's share of K (program_id(2) of SPLITS), in whole BK steps."""
    if SPLITS == 1:
        return 0, K
    per = tl.cdiv(tl.cdiv(K, BK), SPLITS) * BK
    k_lo = tl.program_id(2) * per
    return k_lo, tl.minimum(k_lo + per, K)


@_jit
def _activation(acc_g, acc_u, rw, limit, HAS_LIMIT: tl.constexpr, ODT: tl.constexpr, act_ptr):
    """gate and up (fp32 sums) -> the routed activation in act_ptr's dtype: gate and up
    rounded to x.dtype (F.linear's output), clamped SwiGLU, times the routing weight."""
    gate = acc_g.to(ODT).to(tl.float32)
    up = acc_u.to(ODT).to(tl.float32)
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = gate * tl.sigmoid(gate) * up * rw
    if act_ptr.dtype.element_ty == tl.float16:  # saturate rather than overflow to inf
        act = tl.minimum(tl.maximum(act, -65504.0), 65504.0)
    return act.to(act_ptr.dtype.element_ty)


@_jit
def _store_rows(ptr, rows, row_len, cols, v, rmask, cmask, SWAP: tl.constexpr):
    """v [rows, cols] (SWAP: [cols, rows]) into ptr[row * row_len + col]."""
    rows = rows.to(tl.int64) * row_len
    if SWAP:
        tl.store(ptr + rows[None, :] + cols[:, None], v, mask=cmask[:, None] & rmask[None, :])
    else:
        tl.store(ptr + rows[:, None] + cols[None, :], v, mask=rmask[:, None] & cmask[None, :])


@_jit
def _act_kernel(
    part_ptr, rw_ptr, tok_ptr, blk_rows_ptr, act_ptr, N_INTER, limit,
    HAS_LIMIT: tl.constexpr, ODT: tl.constexpr, SPLITS: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr,
):  # fmt: skip
    # Block b's rows, BN columns: gate and up summed over the splits in split order, then
    # `_activation` as the unsplit kernel's epilogue does it.
    b = tl.program_id(0)
    n_rows = tl.load(blk_rows_ptr + b)
    if n_rows == 0:
        return
    r = tl.arange(0, BM)
    rmask = r < n_rows
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < N_INTER
    m = rmask[:, None] & cmask[None, :]
    rows = b * BM + r
    at = part_ptr + rows.to(tl.int64)[:, None] * (2 * N_INTER) + cols[None, :]
    split_len = tl.num_programs(0) * BM * 2 * N_INTER
    g = tl.zeros([BM, BN], dtype=tl.float32)
    u = tl.zeros([BM, BN], dtype=tl.float32)
    for sp in tl.static_range(SPLITS):
        g += tl.load(at + sp * split_len, mask=m, other=0.0)
        u += tl.load(at + sp * split_len + N_INTER, mask=m, other=0.0)
    a = tl.load(tok_ptr + b * BM + r, mask=rmask, other=0)
    rw = tl.load(rw_ptr + a, mask=rmask, other=0.0)
    act = _activation(g, u, rw[:, None], limit, HAS_LIMIT, ODT, act_ptr)
    _store_rows(act_ptr, rows, N_INTER, cols, act, rmask, cmask, False)


@_jit(varying=("split_len",))
def _down_kernel(
    act_ptr, w_ptr, s_ptr, gs_ptr, tok_ptr, blk_e_ptr, blk_rows_ptr, y_ptr,
    K, N, stride_we, stride_wn, stride_se, stride_sn, split_len,
    FP4: tl.constexpr, SWAP: tl.constexpr, PREC: tl.constexpr, MX: tl.constexpr,
    GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
    SPLITS: tl.constexpr,
):  # fmt: skip
    # SPLITS > 1: program_id(2) takes 1/SPLITS of K, y_ptr is the fp32 partials
    # [SPLITS, T * k, N] that `_sum_kernel` adds.
    b = tl.program_id(0)
    n_rows = tl.load(blk_rows_ptr + b)
    if n_rows == 0:
        return
    e = tl.load(blk_e_ptr + b).to(tl.int64)
    DT = act_ptr.dtype.element_ty
    r = tl.arange(0, BM)
    rmask = r < n_rows
    a = tl.load(tok_ptr + b * BM + r, mask=rmask, other=0)
    x_rows = act_ptr + (b * BM + r).to(tl.int64)[:, None] * K
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = offs_n < N
    w_rows = offs_n.to(tl.int64)
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    gs = 1.0
    if FP4 and not MX:
        gs = tl.load(gs_ptr + e)
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_lo, k_hi = _k_range(K, BK, SPLITS)
    s_next = 0
    if FP4:
        s_next = _scale_tile(s_e, w_rows, nmask, k_lo, K, stride_sn, BK, EVEN_K, GROUP)
    for k0 in range(k_lo, k_hi, BK):
        sk = s_next
        if FP4:
            s_next = _scale_tile(s_e, w_rows, nmask, k0 + BK, K, stride_sn, BK, EVEN_K, GROUP)
        offs_k = k0 + tl.arange(0, BK)
        xm = rmask[:, None] if EVEN_K else rmask[:, None] & (offs_k < K)[None, :]
        xk = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0)
        acc = _weight_dot(
            acc, xk, w_e, sk, gs, w_rows, nmask, k0, K, stride_wn,
            BN, BM, BK, DT, FP4, EVEN_K, SWAP, PREC, MX,
        )  # fmt: skip
    if FP4 and not MX and DT != tl.float32:  # exact-weight routes leave gs * 2^7 to acc
        acc = acc * (gs * 128.0)
    if SPLITS > 1:  # fp32 partials, rounded after _sum_kernel adds them
        y_ptr += tl.program_id(2).to(tl.int64) * split_len
    y = acc.to(y_ptr.dtype.element_ty)  # x.dtype, as F.linear rounds it
    _store_rows(y_ptr, a, N, offs_n, y, rmask, nmask, SWAP)


@_jit(varying=("n_assign",))
def _sum_kernel(
    part_ptr, out_ptr, n_assign, N, top_k,
    SPLITS: tl.constexpr, ODT: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # out[t] = fp32 sum over the k slots, in slot order, of y = (the splits' partials added in
    # split order) rounded to x.dtype (F.linear's output), as the unsplit route sums y.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cm = cols < N
    out = tl.zeros([BN], dtype=tl.float32)
    for j in range(top_k):
        y = tl.zeros([BN], dtype=tl.float32)
        for sp in tl.static_range(SPLITS):
            y += tl.load(part_ptr + (sp * n_assign + t * top_k + j) * N + cols, mask=cm, other=0.0)
        out += y.to(ODT).to(tl.float32)
    tl.store(out_ptr + t * N + cols, out, mask=cm)


# -- entry point ---------------------------------------------------------------------------


def _weights(experts: Experts) -> tuple[str, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(format: dense | nvfp4 | mxfp4, gate_up (weight, scale, global scale), down (...));
    scales that a format lacks are placeholders the kernels never read."""
    fmt = getattr(experts, "fp4_format", "") or "dense"
    if fmt == "mxfp4":
        gu, down = experts.gate_up_packed, experts.down_packed
        gu_s, down_s = experts.gate_up_scale.view(torch.uint8), experts.down_scale.view(torch.uint8)
        return fmt, (gu, gu_s, gu_s), (down, down_s, down_s)
    if fmt == "nvfp4":
        gu = (
            experts.gate_up_packed,
            experts.gate_up_scale.view(torch.uint8),
            experts.gate_up_scale_2.float().contiguous(),
        )
        down = (
            experts.down_packed,
            experts.down_scale.view(torch.uint8),
            experts.down_scale_2.float().contiguous(),
        )
        return fmt, gu, down
    gu, down = experts.gate_up_proj, experts.down_proj
    return fmt, (gu, gu, gu), (down, down, down)


def fused_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    experts: Experts,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """x [T, H] (bf16/fp32), weights [T, k] routing weights, idx [T, k] expert ids in [0, E),
    experts `Experts` (dense), `Fp4Experts` or `Mxfp4Experts` -> [T, H] float32, as `experts.forward(x, weights,
    idx)`. No host sync: capturable in a CUDA graph once compiled (run it once before capture)."""
    fmt, (w1, s1, gs1), (w2, s2, gs2) = _weights(experts)
    fp4, mx = fmt != "dense", fmt == "mxfp4"
    t, h = x.shape
    top_k = idx.shape[1]
    num_experts, two_i = w1.shape[0], w1.shape[1]
    inter = two_i // 2
    for w in (w1, w2, s1, s2):
        if w.stride(-1) != 1:
            raise ValueError("expert weights must be contiguous along their last dimension")
    if w1.shape[2] * (2 if fp4 else 1) != h or tuple(idx.shape) != tuple(weights.shape):
        raise ValueError(f"x {tuple(x.shape)}, idx {tuple(idx.shape)} do not fit the experts")
    if t == 0:
        return torch.zeros(0, h, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    n = t * top_k
    cfg = config or default_config(n, num_experts)
    if fp4 and (cfg.block_k < 32 or cfg.block_k & (cfg.block_k - 1)):
        raise ValueError(f"NVFP4 needs block_k a power of two >= 32, got {cfg.block_k}")
    group = 32 if mx else 16  # inputs per scale
    grouping = group_assignments(idx, num_experts, cfg.block_m)
    nb = grouping.block_expert.numel()
    rw = weights.reshape(-1).float().contiguous()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    odt = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    odt = odt[x.dtype]
    x_mma = x
    if fp4 and not mx and cfg.fp16_mma and x.dtype == torch.bfloat16:
        x_mma = x.clamp(-65504.0, 65504.0).to(torch.float16)  # exact within fp16's range
    act = torch.empty(nb * cfg.block_m, inter, dtype=x_mma.dtype, device=x.device)
    limit = float(experts.limit)
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    blocks = {"BM": cfg.block_m, "BN": cfg.block_n, "BK": cfg.block_k}
    # split_k > 1 (decode: a few rows per expert): K in split_k programs, so that every SM
    # pulls weight bytes; fp32 partials, added in split order by _act_kernel and _sum_kernel.
    splits = cfg.split_k
    gu_out = act
    if splits > 1:
        gu_out = torch.empty(splits, nb * cfg.block_m, two_i, dtype=torch.float32, device=x.device)
    _gate_up_kernel[(nb, triton.cdiv(inter, cfg.block_n), splits)](
        x_mma, w1, s1, gs1, rw, *grouping, gu_out,
        h, inter, top_k, limit,
        x_mma.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
        FP4=fp4, HAS_LIMIT=limit > 0, SWAP=cfg.swap_ab, PREC=prec, MX=mx, GROUP=group, **blocks,
        EVEN_K=h % cfg.block_k == 0, ODT=odt, SPLITS=splits, **launch,
    )  # fmt: skip
    if splits > 1:
        _act_kernel[(nb, triton.cdiv(inter, ACT_BLOCK_N))](
            gu_out, rw, grouping.token_ids, grouping.block_rows, act, inter, limit,
            HAS_LIMIT=limit > 0, ODT=odt, SPLITS=splits, BM=cfg.block_m, BN=ACT_BLOCK_N,
        )  # fmt: skip
    y_dtype = torch.float32 if splits > 1 else x.dtype
    y = torch.empty(splits, n, h, dtype=y_dtype, device=x.device)
    _down_kernel[(nb, triton.cdiv(h, cfg.block_n), splits)](
        act, w2, s2, gs2, *grouping, y,
        inter, h, w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), n * h,
        FP4=fp4, SWAP=cfg.swap_ab, PREC=prec, MX=mx, GROUP=group, **blocks,
        EVEN_K=inter % cfg.block_k == 0, SPLITS=splits, **launch,
    )  # fmt: skip
    if splits == 1:
        return y.view(t, top_k, h).sum(dim=1, dtype=torch.float32)
    out = torch.empty(t, h, dtype=torch.float32, device=x.device)
    _sum_kernel[(t, triton.cdiv(h, SUM_BLOCK_N))](
        y, out, n, h, top_k, SPLITS=splits, ODT=odt, BN=SUM_BLOCK_N
    )
    return out
