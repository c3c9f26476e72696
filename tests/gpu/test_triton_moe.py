"""The Triton fused MoE (kvrelay/kernels/triton_moe.py) against the torch reference
`Experts.forward` / `Fp4Experts.forward` / `Mxfp4Experts.forward`: dense fp32 (rel err < 1e-5)
and bf16 (< 1e-2), NVFP4 and MXFP4,
tiny and DeepSeek-V4-mini shapes, top-k, hash-like and all-to-one routing, the grouping kernel
against the torch grouping, determinism, and CUDA-graph replay == eager.

Fresh random inputs for every check, never zeros; the caching allocator's free blocks are
filled with NaN before each run, so an intermediate row that the kernels fail to write shows up
as NaN in the output.

Quick tier (`pytest -m gpu`): the kernels at their default configs: tiny dense fp32 and NVFP4
bf16, DeepSeek-V4-mini NVFP4 (decode and a 4096-token prefill), MXFP4 and dense bf16, the fp64
oracle, grouping, determinism and graph replay, one case each. gpu_full (`pytest -m gpu_full`):
every other shape x token count x routing x format x dtype, every explicit tile config (SWAP_AB,
the fp16 route) and the MXFP4 sweep.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib

import pytest
import torch
from conftest import tiered

from kvrelay.kernels.moe_grouping import group_by_expert
from kvrelay.kernels.triton_moe import (
    GROUP_MAX_ASSIGN,
    MoeConfig,
    default_config,
    fused_experts,
    group_assignments,
)
from kvrelay.models.deepseek_v4 import preset
from kvrelay.models.deepseek_v4.experts import Experts, Fp4Experts, Mxfp4Experts, QuantizedExperts
from kvrelay.quant.nvfp4 import dequantize_nvfp4

pytestmark = pytest.mark.gpu

TINY = [(8, 64, 32, 2), (8, 160, 192, 2)]  # E, H, I, k
MINI = (256, 4096, 2048, 6)
TOKENS = [1, 7, 64, 300]
ROUTINGS = ["topk", "hash", "one"]
FORMATS = [  # (fp4, dtype, tol)
    (False, torch.float32, 1e-5),
    (False, torch.bfloat16, 1e-2),
    (True, torch.bfloat16, 1e-2),
    (True, torch.float32, 1e-5),
]


def _tiny_id(case) -> str:
    fp4, dtype, _, (e, h, i, _), t, mode = case
    return f"{'nvfp4' if fp4 else 'dense'}-{str(dtype)[6:]}-E{e}H{h}I{i}-t{t}-{mode}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _poison_free_memory() -> None:
    """Fill blocks the caching allocator will hand out next with NaN (small and large pools)."""
    blocks = [torch.full((1 << 16,), float("nan"), device="cuda") for _ in range(64)]
    blocks += [torch.full((1 << 26,), float("nan"), device="cuda") for _ in range(4)]
    del blocks


def _experts(e: int, h: int, i: int, fp4: bool, dtype: torch.dtype, gen: torch.Generator):
    cfg = preset("dsv4-tiny").with_(
        n_routed_experts=e, hidden_size=h, moe_intermediate_size=i,
        expert_format="nvfp4" if fp4 else "dense",
    )  # fmt: skip
    dev = "cuda"
    with torch.no_grad():
        if not fp4:
            ex = Experts(cfg, dtype).to(dev)
            ex.gate_up_proj.copy_(torch.randn(e, 2 * i, h, generator=gen, device=dev) / h**0.5)
            ex.down_proj.copy_(torch.randn(e, h, i, generator=gen, device=dev) / i**0.5)
            return ex
        ex = Fp4Experts(cfg, dtype).to(dev)
        for p, s in ((ex.gate_up_packed, ex.gate_up_scale), (ex.down_packed, ex.down_scale)):
            p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, generator=gen, device=dev))
            s.copy_((torch.rand(s.shape, generator=gen, device=dev) * 3 + 0.05).to(s.dtype))
        ex.gate_up_scale_2.copy_((torch.rand(e, 2, generator=gen, device=dev) + 0.1) * 0.1 / h**0.5)
        ex.down_scale_2.copy_((torch.rand(e, generator=gen, device=dev) + 0.1) * 0.1 / i**0.5)
    return ex


def _routing(t: int, e: int, k: int, mode: str, gen: torch.Generator):
    dev = "cuda"
    if mode == "topk":
        idx = torch.rand(t, e, generator=gen, device=dev).topk(k, dim=-1).indices
    elif mode == "one":  # every token to the same k experts
        idx = torch.randperm(e, generator=gen, device=dev)[:k].expand(t, k).contiguous()
    else:  # hash-like: a few rows of k distinct experts (a tid2eid table), tokens repeat them
        table = torch.rand(5, e, generator=gen, device=dev).argsort(dim=-1)[:, :k]
        idx = table[torch.randint(0, 5, (t,), generator=gen, device=dev)].contiguous()
    w = torch.rand(t, k, generator=gen, device=dev) * 2 + 0.05
    return w, idx


def _check(ex, t: int, mode: str, dtype: torch.dtype, tol: float, gen, config=None, rounds=2):
    down = ex.down_packed if isinstance(ex, QuantizedExperts) else ex.down_proj
    e, h = down.shape[0], down.shape[1]
    k = 6 if e == 256 else 2
    for _ in range(rounds):  # fresh inputs each round
        x = (torch.randn(t, h, generator=gen, device="cuda") * 2).to(dtype)
        w, idx = _routing(t, e, k, mode, gen)
        want = ex.forward(x, w, idx)
        _poison_free_memory()
        got = fused_experts(x, w, idx, ex, config)
        assert got.dtype == torch.float32 and got.shape == (t, h)
        assert torch.isfinite(got).all(), "an unwritten (NaN-poisoned) row reached the output"
        err = _rel(got, want)
        assert err < tol, (t, mode, dtype, err)


@tiered(
    "fp4,dtype,tol,shape,t,mode",
    [
        (*f, shape, t, mode)
        for f, shape, t, mode in itertools.product(FORMATS, TINY, TOKENS, ROUTINGS)
    ],
    quick=["dense-float32-E8H64I32-t7-hash", "nvfp4-bfloat16-E8H160I192-t300-topk"],
    ids=_tiny_id,
)
def test_tiny(shape, t, mode, fp4, dtype, tol) -> None:
    gen = torch.Generator(device="cuda").manual_seed(
        zlib.crc32(repr((shape, t, mode, fp4, str(dtype))).encode())
    )
    e, h, i, _ = shape
    ex = _experts(e, h, i, fp4, dtype, gen)
    _check(ex, t, mode, dtype, tol, gen)
    ex.limit = 0.0  # the clamp disabled
    _check(ex, t, mode, dtype, tol, gen, rounds=1)


@pytest.mark.gpu_full
@pytest.mark.parametrize(
    "config",
    [
        MoeConfig(16, 32, 32, 4, 2, False),
        MoeConfig(16, 32, 128, 4, 3, False),
        MoeConfig(16, 64, 128, 4, 3, True),
        MoeConfig(32, 64, 64, 4, 3, False),
        MoeConfig(64, 128, 64, 8, 3, True),
        MoeConfig(64, 64, 64, 4, 2, False),
        MoeConfig(128, 64, 64, 8, 3, False),
        MoeConfig(16, 32, 128, 4, 3, False, True),
        MoeConfig(128, 64, 64, 8, 3, True, True),
        MoeConfig(16, 32, 32, 4, 2, False, False, 3),  # split K, the last split short
        MoeConfig(16, 64, 128, 4, 3, True, False, 4),
        MoeConfig(64, 64, 64, 4, 3, False, True, 2),
    ],
    ids=str,
)
@pytest.mark.parametrize("fp4", [False, True])
@pytest.mark.parametrize("h,i", [(160, 192), (256, 128)])  # K masked / a multiple of BLOCK_K
def test_every_tile_shape_and_operand_order(config, fp4, h, i) -> None:
    gen = torch.Generator(device="cuda").manual_seed(7)
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        ex = _experts(8, h, i, fp4, dtype, gen)
        for t, mode in ((7, "hash"), (300, "topk")):
            _check(ex, t, mode, dtype, tol, gen, config, rounds=1)


def _exact_oracle(ex: Fp4Experts, x, w, idx) -> torch.Tensor:
    """The MoE in float64 on exactly dequantized NVFP4 weights, no intermediate rounding."""
    e, two_i, h2 = ex.gate_up_packed.shape
    halves = (2, two_i // 2, -1)
    gu = torch.stack([
        dequantize_nvfp4(
            ex.gate_up_packed[j].view(halves), ex.gate_up_scale[j].view(halves),
            ex.gate_up_scale_2[j], torch.float64,
        ).flatten(0, 1)
        for j in range(e)
    ])  # fmt: skip
    dn = torch.stack([
        dequantize_nvfp4(ex.down_packed[j], ex.down_scale[j], ex.down_scale_2[j], torch.float64)
        for j in range(e)
    ])  # fmt: skip
    cfg = preset("dsv4-tiny").with_(
        n_routed_experts=e, hidden_size=2 * h2, moe_intermediate_size=two_i // 2
    )
    ref = Experts(cfg, torch.float64).to(x.device)
    ref.limit = ex.limit
    with torch.no_grad():
        ref.gate_up_proj.copy_(gu)
        ref.down_proj.copy_(dn)
    return ref.forward(x.double(), w.double(), idx)


@tiered("t", [7, 64], quick=[7])
def test_nvfp4_routes_against_an_fp64_oracle(t) -> None:
    """Both bf16 routes keep the NVFP4 weights exact (e2m1 * scale in bf16 or fp16, the global
    scale on the accumulator) where the reference rounds each weight to bf16: both are closer
    to the exact result than the reference is."""
    gen = torch.Generator(device="cuda").manual_seed(100 + t)
    ex = _experts(16, 1024, 512, True, torch.bfloat16, gen)
    for _ in range(2):
        x = torch.randn(t, 1024, generator=gen, device="cuda").to(torch.bfloat16)
        w, idx = _routing(t, 16, 6, "topk", gen)
        exact = _exact_oracle(ex, x, w, idx)
        ref = _rel(ex.forward(x, w, idx), exact)
        default = _rel(fused_experts(x, w, idx, ex), exact)
        f16 = _rel(fused_experts(x, w, idx, ex, MoeConfig(16, 32, 128, 4, 3, False, True)), exact)
        assert default < ref and f16 < ref, (ref, default, f16)


@pytest.fixture(scope="module")
def mini_fp4():
    e, h, i, _ = MINI
    return _experts(e, h, i, True, torch.bfloat16, torch.Generator(device="cuda").manual_seed(3))


@tiered(
    "t,mode",
    list(itertools.product([1, 7, 64, 300, 4096], ROUTINGS)),
    quick=[(1, "topk"), (64, "hash"), (4096, "topk")],
    ids=lambda c: f"t{c[0]}-{c[1]}",
)
def test_mini_nvfp4(mini_fp4, t, mode) -> None:
    if t == 4096 and mode != "topk":
        pytest.skip("one prefill-sized routing is enough")
    gen = torch.Generator(device="cuda").manual_seed(t * 31 + len(mode))
    _check(mini_fp4, t, mode, torch.bfloat16, 1e-2, gen, rounds=1 if t == 4096 else 2)


@tiered("t,split", [(1, 4), (7, 2), (64, 8), (1, 8)], quick=[(1, 4)], ids=str)
def test_mini_nvfp4_split_k(mini_fp4, t, split) -> None:
    """K split over programs (decode): the partials added in split order, then the same
    epilogues; every row the grouping made is written (the NaN poison would show)."""
    gen = torch.Generator(device="cuda").manual_seed(t * 13 + split)
    cfg = dataclasses.replace(default_config(t * 6, 256), split_k=split)
    _check(mini_fp4, t, "topk", torch.bfloat16, 1e-2, gen, cfg)


@pytest.mark.gpu_full
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_mini_nvfp4_fp16_route(mini_fp4, t) -> None:
    gen = torch.Generator(device="cuda").manual_seed(t * 17)
    cfg = dataclasses.replace(default_config(t * 6, 256), fp16_mma=True)
    _check(mini_fp4, t, "topk", torch.bfloat16, 1e-2, gen, cfg, rounds=1)


@tiered("t", [1, 64, 300], quick=[64])
def test_mini_dense_bf16_few_experts(t) -> None:
    # DeepSeek-V4-mini's expert shape; 16 experts' worth of dense weights is enough here
    gen = torch.Generator(device="cuda").manual_seed(t)
    _, h, i, _ = MINI
    ex = _experts(16, h, i, False, torch.bfloat16, gen)
    for _ in range(2):
        x = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
        w, idx = _routing(t, 16, 6, "topk", gen)
        want = ex.forward(x, w, idx)
        _poison_free_memory()
        got = fused_experts(x, w, idx, ex)
        assert torch.isfinite(got).all() and _rel(got, want) < 1e-2


@tiered(
    "n_tokens,e,k,bm",
    [
        (*c, bm)
        for bm in (16, 32, 64)
        for c in ((1, 8, 2), (7, 256, 6), (300, 256, 6), (1024, 8, 2))
    ],
    quick=[(7, 256, 6, 16)],  # every fused_experts call of the quick tier groups on the GPU too
    ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}-bm{c[3]}",
)
def test_grouping_kernel_equals_torch(n_tokens, e, k, bm) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n_tokens + e + bm)
    for mode in ROUTINGS:
        _, idx = _routing(n_tokens, e, k, mode, gen)
        assert idx.numel() <= GROUP_MAX_ASSIGN
        got = group_assignments(idx, e, bm)
        want = group_by_expert(idx, e, bm)
        cpu = group_by_expert(idx.cpu(), e, bm)
        assert torch.equal(got.block_expert, want.block_expert)
        assert torch.equal(got.block_rows, want.block_rows)
        used = (torch.arange(bm, device="cuda")[None, :] < want.block_rows[:, None]).reshape(-1)
        assert torch.equal(got.token_ids[used], want.token_ids[used])
        assert torch.equal(want.block_rows.cpu(), cpu.block_rows)
        assert torch.equal(want.token_ids[used].cpu(), cpu.token_ids[used.cpu()])


def test_deterministic() -> None:
    gen = torch.Generator(device="cuda").manual_seed(11)
    ex = _experts(8, 160, 192, True, torch.bfloat16, gen)
    x = torch.randn(300, 160, generator=gen, device="cuda").to(torch.bfloat16)
    w, idx = _routing(300, 8, 2, "topk", gen)
    first = fused_experts(x, w, idx, ex)
    for _ in range(3):
        assert torch.equal(fused_experts(x, w, idx, ex), first)


@tiered(
    "t,e,k,fp4",  # 1100*2 assignments: the torch grouping
    [(*c, fp4) for fp4 in (False, True) for c in ((7, 8, 2), (64, 256, 6), (1100, 8, 2))],
    quick=[(64, 256, 6, True)],
    ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}-{'nvfp4' if c[3] else 'dense'}",
)
def test_cuda_graph_replay_equals_eager(t, e, k, fp4) -> None:
    gen = torch.Generator(device="cuda").manual_seed(t + e)
    h, i = (160, 192) if e == 8 else (512, 256)
    ex = _experts(e, h, i, fp4, torch.bfloat16, gen)
    x = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
    w, idx = _routing(t, e, k, "topk", gen)
    cfg = default_config(t * k, e)
    fused_experts(x, w, idx, ex, cfg)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w, idx, ex, cfg)
    for mode in ROUTINGS:
        new_w, new_idx = _routing(t, e, k, mode, gen)
        x.copy_(torch.randn(t, h, generator=gen, device="cuda"))
        w.copy_(new_w)
        idx.copy_(new_idx)
        graph.replay()
        eager = fused_experts(x, w, idx, ex, cfg)
        assert torch.equal(out, eager), mode
        assert _rel(out, ex.forward(x, w, idx)) < 1e-2


def _mx_experts(e: int, h: int, i: int, dtype: torch.dtype, gen: torch.Generator):
    cfg = preset("dsv4-tiny").with_(
        n_routed_experts=e, hidden_size=h, moe_intermediate_size=i, expert_format="mxfp4"
    )
    ex = Mxfp4Experts(cfg, dtype).to("cuda")
    with torch.no_grad():
        for p, s in ((ex.gate_up_packed, ex.gate_up_scale), (ex.down_packed, ex.down_scale)):
            p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, generator=gen, device="cuda"))
            fan_in = 127 - round(math.log2(2.93 * (2 * p.shape[-1]) ** 0.5))
            # scales spread over +-3 octaves around fan-in scaling, and a few 2^-127 (byte 0)
            s.copy_(torch.randint(fan_in - 3, fan_in + 4, s.shape, generator=gen, device="cuda"))
            s.view(-1)[::97] = 0
    return ex


@pytest.mark.gpu_full  # the MXFP4 kernels' quick-tier case: test_mxfp4_mini_shape
@pytest.mark.parametrize(
    "config",
    [
        None,
        MoeConfig(16, 32, 32, 4, 2),
        MoeConfig(16, 64, 128, 4, 3, True),
        MoeConfig(64, 64, 64, 4, 3),
        MoeConfig(128, 128, 64, 8, 3),
        MoeConfig(16, 32, 128, 4, 3, False, True),  # fp16 route asked: MXFP4 keeps fp32 scales
    ],
)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("h,i", [(64, 32), (160, 192)])  # K a multiple of BLOCK_K / masked
def test_mxfp4_experts(config, dtype, tol, h, i) -> None:
    """DeepSeek's native MXFP4 experts (e8m0 scale per 32 inputs, no global scale) read packed
    by the same kernels: equal to dequantize-then-compute (`Mxfp4Experts.forward`)."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((config, h, i)).encode()))
    ex = _mx_experts(8, h, i, dtype, gen)
    for t in (1, 7, 64, 300):
        _check(ex, t, "topk", dtype, tol, gen, config, rounds=1)


def test_mxfp4_mini_shape() -> None:
    gen = torch.Generator(device="cuda").manual_seed(23)
    e, h, i, _ = MINI
    ex = _mx_experts(e, h, i, torch.bfloat16, gen)
    for t in (1, 64, 1024):
        _check(ex, t, "topk", torch.bfloat16, 1e-2, gen, rounds=1)
