from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.quant import (
    decode_e2m1,
    dequantize_fp4_ue8m0,
    e2m1_lut,
    encode_e2m1,
    fake_quant_fp4,
    pack_e2m1,
    quantize_fp4_ue8m0,
    ue8m0_to_float,
    unpack_e2m1,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]
NAN = float("nan")

# Every e2m1 code, written by hand: s.ee.m with bias 1; ee = 0 is subnormal (0, 0.5).
E2M1_CODES = {
    0b0000: 0.0,
    0b0001: 0.5,
    0b0010: 1.0,
    0b0011: 1.5,
    0b0100: 2.0,
    0b0101: 3.0,
    0b0110: 4.0,
    0b0111: 6.0,
    0b1000: -0.0,
    0b1001: -0.5,
    0b1010: -1.0,
    0b1011: -1.5,
    0b1100: -2.0,
    0b1101: -3.0,
    0b1110: -4.0,
    0b1111: -6.0,
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float().cpu(), b.float().cpu()
    both_nan = a.isnan() & b.isnan()
    return bool((both_nan | ((a == b) & (a.signbit() == b.signbit()))).all())


@pytest.mark.parametrize("device", DEVICES)
def test_every_code_decodes(device: str) -> None:
    codes = torch.tensor(list(E2M1_CODES), dtype=torch.uint8, device=device)
    assert _same(decode_e2m1(codes), torch.tensor(list(E2M1_CODES.values())))
    assert _same(e2m1_lut(), torch.tensor(list(E2M1_CODES.values())))


@pytest.mark.parametrize("device", DEVICES)
def test_encode_every_value_and_ties(device: str) -> None:
    vals = torch.tensor(list(E2M1_CODES.values()), device=device)
    assert encode_e2m1(vals).tolist() == list(E2M1_CODES)
    # Ties go to the even code; above 6 saturates; below 0.25 flushes to (signed) zero.
    x = torch.tensor(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0, 6.5, 1e30, -7.0, 0.2, -0.1, 0.26, 4.9],
        device=device,
    )
    want = [0, 2, 2, 4, 4, 6, 6, 10, 14, 7, 7, 15, 0, 8, 1, 6]
    assert encode_e2m1(x).tolist() == want
    assert encode_e2m1(x).dtype == torch.uint8


def test_pack_nibble_order_hand_example() -> None:
    # Element 2k in the low nibble, 2k+1 in the high nibble (reference §6/§7).
    codes = torch.tensor([[0x1, 0x2, 0x3, 0x4], [0xF, 0x0, 0x8, 0x7]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0x78]]
    assert torch.equal(unpack_e2m1(packed), codes)
    # The checkpoints store these bytes as I8 (native MXFP4) or U8 (NVFP4): same bits.
    assert unpack_e2m1(torch.tensor([-1, 0x70], dtype=torch.int8)).tolist() == [15, 15, 0, 7]
    assert decode_e2m1(unpack_e2m1(torch.tensor([0x21], dtype=torch.uint8))).tolist() == [0.5, 1.0]


def test_pack_unpack_all_bytes() -> None:
    every = torch.arange(256, dtype=torch.uint8)
    codes = unpack_e2m1(every)
    assert codes.shape == (512,)
    assert torch.equal(codes[0::2], every & 0xF) and torch.equal(codes[1::2], every >> 4)
    assert torch.equal(pack_e2m1(codes), every)
    fp4x2 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4x2 is not None:
        assert torch.equal(unpack_e2m1(every.view(fp4x2)), codes)
    with pytest.raises(ValueError):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError):
        unpack_e2m1(torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_fake_quant_fp4_hand_values(device: str) -> None:
    x = torch.zeros(3, 32, device=device)
    x[0, :6] = torch.tensor([6.0, 0.3, 0.8, 2.6, 5.5, -4.9])  # amax 6 -> s = 1
    x[1, :2] = torch.tensor([7.0, 1.0])  # amax 7 -> s = 2: 3.5 -> 4 (tie to even), 0.5
    x[2, 0] = 0.0  # zero block: floored amax gives s = 2^-126, stays 0
    got = fake_quant_fp4(x)
    assert got[0, :6].tolist() == [6.0, 0.5, 1.0, 3.0, 6.0, -4.0]
    assert got[1, :2].tolist() == [8.0, 1.0]
    assert not got[2].any()
    packed, s = quantize_fp4_ue8m0(x, 32, "uint8")
    assert packed.shape == (3, 16) and packed.dtype == torch.uint8
    assert s[:, 0].tolist() == [127, 128, 1]


def test_fake_quant_fp4_dtype_nan_and_shape() -> None:
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    x[0, 40] = NAN
    out = fake_quant_fp4(x)
    assert out.dtype == torch.bfloat16
    assert out[0, 32:].isnan().all() and torch.equal(out[0, :32], x[0, :32])
    assert torch.equal(out[1], x[1])
    with pytest.raises(ValueError):
        fake_quant_fp4(torch.ones(2, 40))
    with pytest.raises(ValueError):
        dequantize_fp4_ue8m0(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2))


def _fake_quant_oracle(x: torch.Tensor, block: int) -> torch.Tensor:
    """Slow independent version: nearest e2m1 with ties to the even code, Python math for s."""
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    out = torch.empty_like(x)
    for r in range(x.shape[0]):
        for b in range(0, x.shape[1], block):
            seg = x[r, b : b + block]
            amax = max(float(seg.abs().max()), 6 * 2.0**-126)
            s = 2.0 ** math.ceil(math.log2(amax / 6.0))
            for i, v in enumerate(seg.tolist()):
                a = min(abs(v) / s, 6.0)
                best = min(range(8), key=lambda c: (abs(grid[c] - a), c % 2))
                out[r, b + i] = math.copysign(grid[best] * s, v)
    return out


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(-20, 20))
def test_fake_quant_fp4_matches_oracle(seed: int, log_scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 128, generator=gen) * 2.0**log_scale
    x[0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 2.0 ** round(log_scale)
    assert torch.equal(fake_quant_fp4(x), _fake_quant_oracle(x, 32))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.floats(-60, 60), st.integers(0, 2**31 - 1))
def test_random_error_bound_and_idempotence(
    rows: int, nblocks: int, log_scale: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 32 * nblocks, generator=gen) * 2.0**log_scale
    packed, s = quantize_fp4_ue8m0(x)
    back = dequantize_fp4_ue8m0(packed, s, dtype=torch.float32)
    step = ue8m0_to_float(s).repeat_interleave(32, -1)
    # One mantissa bit: relative error <= 1/4 above s, absolute <= s/4 below it.
    assert bool(((back - x).abs() <= 0.25 * torch.maximum(x.abs(), step)).all())
    assert torch.equal(fake_quant_fp4(back), back)
    assert torch.equal(fake_quant_fp4(x), back)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 128, generator=gen) * torch.logspace(-30, 30, 128, base=2.0)
    x[3, 7] = float("inf")
    packed, s = quantize_fp4_ue8m0(x)
    pc, sc = quantize_fp4_ue8m0(x.cuda())
    assert torch.equal(pc.cpu(), packed) and torch.equal(
        sc.cpu().view(torch.uint8), s.view(torch.uint8)
    )
    assert _same(fake_quant_fp4(x.cuda()), fake_quant_fp4(x))
