"""The compiled glue of the DeepSeek-V4 fast path (`fusion.fusable`) against its eager torch code,
on fresh random inputs on the GPU, at the shapes the model calls it with (T = 1 and varlen T).

Quick tier (`pytest -m gpu`): RoPE, the QAT rounding, the mHC glue and hashed routing once in
bf16 (where the compiled code must keep the eager bf16 roundings) at a varlen T; all the glue runs
compiled in fp32 in the quick tier's fast-path engine tests (test_dsv4_fast_gpu.py, against the
eager reference path). gpu_full (`pytest -m gpu_full`): every dtype x T x flag, bias routing and
the shared expert's glue."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiered

from kvrelay.models.deepseek_v4.fusion import fused_glue
from kvrelay.models.deepseek_v4.mhc import _stream_mix, collapse, merge_streams
from kvrelay.models.deepseek_v4.moe import add_wide, route, swiglu_down_input
from kvrelay.models.deepseek_v4.qat import rope_round_fp8
from kvrelay.models.deepseek_v4.rope import apply_rope, rope_inv_freq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = (torch.float32, torch.bfloat16)
TOKENS = (1, 5, 64)
BF16 = torch.bfloat16


def _id(case) -> str:
    case = case if isinstance(case, tuple) else (case,)
    return "-".join(str(v)[6:] if isinstance(v, torch.dtype) else str(v) for v in case)


def both(fn, *args):
    """(eager, compiled) outputs of a fusable function."""
    eager = fn.eager(*args)
    with fused_glue():
        fused = fn(*args)
    return eager, fused


def close(a, b, dtype) -> None:
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(b.float(), a.float(), **tol)


def rounded_close(a, b) -> None:
    """Outputs of a rounding (FP8/FP4): a last-ulp difference before it may flip one code, so
    nearly every element is equal and none is off by more than its block's step."""
    a, b = a.float(), b.float()
    equal = (a == b).float().mean().item()
    assert equal > 0.995, equal
    torch.testing.assert_close(b, a, atol=0.5 * a.abs().max().item(), rtol=0.5)


def cos_sin(n: int, dim: int = 64):
    pos = torch.randint(0, 32768, (n,), device="cuda")
    angles = pos.float()[:, None] * rope_inv_freq(dim, 10000.0).float().cuda()[None]
    return angles.cos(), angles.sin()


@tiered(
    "dtype,n,inverse",
    list(itertools.product(DTYPES, TOKENS, (False, True))),
    quick=[(BF16, 5, False)],
    ids=_id,
)
def test_rope(dtype, n, inverse):
    q = torch.randn(n, 8, 512, device="cuda", dtype=dtype)
    c, s = cos_sin(n)
    eager = apply_rope.eager(q, c, s, inverse)
    with fused_glue():
        fused = apply_rope(q, c, s, inverse)
    close(eager, fused, dtype)


@tiered(
    "dtype,n,qat",
    list(itertools.product(DTYPES, TOKENS, (False, True))),
    quick=[(BF16, 5, True)],
    ids=_id,
)
def test_rope_round_fp8(dtype, n, qat):
    kv = torch.randn(n, 512, device="cuda", dtype=dtype) * 3
    c, s = cos_sin(n)
    eager, fused = both(rope_round_fp8, kv, c, s, 448, qat)
    if qat:  # the nope dims are rounded to FP8, the RoPE dims only rotated
        rounded_close(eager[:, :448], fused[:, :448])
    close(eager[:, 448:], fused[:, 448:], dtype)


@tiered("dtype", DTYPES, quick=[BF16], ids=_id)
def test_qat_scales_at_powers_of_two(dtype):
    """Blocks whose amax / qmax is exactly a power of two: the compiled scale must not round
    up a step (approximate division or log2 would)."""
    x = torch.randn(64, 512, device="cuda", dtype=dtype)
    x[:, 0] = 448.0 * 2.0 ** torch.randint(-8, 4, (64,), device="cuda").to(dtype)
    c, s = cos_sin(64)
    eager, fused = both(rope_round_fp8, x, c, s, 448, True)
    assert torch.equal(eager[:, :64], fused[:, :64])


@tiered("dtype,n", list(itertools.product(DTYPES, TOKENS)), quick=[(BF16, 5)], ids=_id)
def test_hyper_connection_glue(dtype, n):
    streams = torch.randn(n, 4, 1024, device="cuda", dtype=dtype)
    fn = torch.randn(24, 4 * 1024, device="cuda") * 0.01
    close(*both(_stream_mix, streams, fn, 1e-6), torch.float32)
    pre = torch.rand(n, 4, device="cuda")
    close(*both(collapse, pre, streams), dtype)
    out = torch.randn(n, 1024, device="cuda", dtype=dtype)
    post, comb = torch.rand(n, 4, device="cuda") * 2, torch.rand(n, 4, 4, device="cuda")
    close(*both(merge_streams, out, streams, post, comb), dtype)


@tiered(
    "n,hashed",
    list(itertools.product(TOKENS, (False, True))),
    quick=[(5, True)],
    ids=_id,
)
def test_route(n, hashed):
    logits = torch.randn(n, 256, device="cuda")
    ids = torch.randint(0, 256, (n, 6), device="cuda") if hashed else None
    bias = None if hashed else torch.randn(256, device="cuda") * 0.1
    (w0, i0), (w1, i1) = both(route, logits, ids, bias, 6, "sqrtsoftplus", True, 1.5)
    assert torch.equal(i0, i1)
    close(w0, w1, torch.float32)


@pytest.mark.gpu_full
@pytest.mark.parametrize("dtype,n", list(itertools.product(DTYPES, TOKENS)), ids=_id)
def test_shared_expert_glue(dtype, n):
    gate, up = (torch.randn(n, 2048, device="cuda", dtype=dtype) * 4 for _ in range(2))
    close(*both(swiglu_down_input, gate, up, 10.0), dtype)
    routed = torch.randn(n, 1024, device="cuda")
    shared = torch.randn(n, 1024, device="cuda", dtype=dtype)
    close(*both(add_wide, routed, shared), dtype)
