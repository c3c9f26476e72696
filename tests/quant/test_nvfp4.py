from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from kvrelay.quant import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e4m3_to_float,
    pack_e2m1,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
    scale_name_for,
    scale_names_for,
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
HYP = settings(max_examples=40, deadline=None)


@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_hand_example(device: str) -> None:
    # One row, K = 32: two blocks of 16 with e4m3 scales 1.0 (0x38) and 2.0 (0x40); global 0.5.
    codes = torch.zeros(1, 32, dtype=torch.uint8)
    codes[0, :4] = torch.tensor([7, 15, 1, 10])  # 6, -6, 0.5, -1
    codes[0, 16:18] = torch.tensor([5, 13])  # 3, -3
    packed = pack_e2m1(codes)
    assert packed[0, 0].item() == 0xF7 and packed[0, 1].item() == 0xA1
    block_scale = torch.tensor([[0x38, 0x40]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = dequantize_nvfp4(
        packed.to(device), block_scale.to(device), torch.tensor(0.5), torch.float32
    )
    expected = torch.zeros(1, 32)
    expected[0, :4] = torch.tensor([3.0, -3.0, 0.25, -0.5])
    expected[0, 16:18] = torch.tensor([3.0, -3.0])
    assert torch.equal(got.cpu(), expected)


def test_dequantize_multiplication_order() -> None:
    # w = (e2m1 * weight_scale) * weight_scale_2: 3 * 3.5 = 10.5 exactly, 10.5 * fp32(1/3) = 3.5
    # in float32, while 3 * (3.5 * fp32(1/3)) would round to 3.5000002.
    packed = pack_e2m1(torch.tensor([[5] + [0] * 15], dtype=torch.uint8))
    block_scale = torch.tensor([[0x46]], dtype=torch.uint8)  # e4m3 3.5, as raw bytes
    assert e4m3_to_float(block_scale).item() == 3.5
    gs = torch.tensor(1.0 / 3.0, dtype=torch.float32)
    got = dequantize_nvfp4(packed, block_scale, gs, torch.float32)
    assert got[0, 0].item() == 3.5


def test_nan_scale_and_shape_checks() -> None:
    packed = torch.full((2, 16), 0x22, dtype=torch.uint8)
    bs = torch.full((2, 2), 0x38, dtype=torch.uint8)
    bs[1, 0] = 0x7F  # e4m3 NaN
    got = dequantize_nvfp4(packed, bs, 1.0, torch.float32)
    assert got[1, :16].isnan().all() and int(got.isnan().sum()) == 16
    with pytest.raises(ValueError, match="weight_scale shape"):
        dequantize_nvfp4(packed, bs[:, :1], 1.0)
    with pytest.raises(ValueError):
        dequantize_nvfp4(packed, bs, torch.ones(3))
    with pytest.raises(ValueError, match="NaN or infinity"):
        quantize_nvfp4(torch.full((2, 16), float("nan")))


def test_quantize_layout_matches_checkpoint() -> None:
    # Scaled-down w1: [N, K] -> U8 [N, K/2], F8_E4M3 [N, K/16], F32 scalars (reference §7 table).
    w = torch.randn(64, 256)
    q = quantize_nvfp4(w, input_scale=0.25)
    assert q.weight.dtype == torch.uint8 and q.weight.shape == (64, 128)
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (64, 16)
    assert q.weight_scale_2.dtype == torch.float32 and q.weight_scale_2.shape == ()
    assert q.input_scale.dtype == torch.float32 and q.input_scale.item() == 0.25
    # The recipe's global scale maps the largest block onto e4m3's max.
    assert q.weight_scale_2.item() == pytest.approx(w.abs().max().item() / (6 * 448), rel=1e-6)
    assert e4m3_to_float(q.weight_scale).max().item() == 448.0


def test_stacked_experts_with_per_expert_global_scale() -> None:
    w = torch.randn(3, 32, 64) * torch.tensor([1.0, 100.0, 0.01])[:, None, None]
    q = quantize_nvfp4(w)
    assert q.weight_scale_2.shape == (3,) and q.input_scale.shape == (3,)
    back = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, torch.float32)
    for e in range(3):
        qe = quantize_nvfp4(w[e])
        assert torch.equal(qe.weight, q.weight[e])
        assert torch.equal(
            back[e], dequantize_nvfp4(qe.weight, qe.weight_scale, qe.weight_scale_2, torch.float32)
        )


def test_zero_and_underflowing_blocks() -> None:
    w = torch.zeros(1, 48)
    w[0, 0] = 6 * 448.0  # sets weight_scale_2 = 1
    w[0, 16] = 1e-4  # block scale 1e-4/6 rounds to e4m3 0 -> the block encodes as zeros
    q = quantize_nvfp4(w)
    assert q.weight_scale_2.item() == 1.0
    assert e4m3_to_float(q.weight_scale).tolist() == [[448.0, 0.0, 0.0]]
    back = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, torch.float32)
    assert back[0, 0].item() == 6 * 448.0 and not back[0, 1:].any()
    all_zero = quantize_nvfp4(torch.zeros(4, 32))
    assert all_zero.weight_scale_2.item() == 1.0 and not all_zero.weight.any()


@st.composite
def representable_nvfp4(draw):
    """Codes with a +-6 in every block, normal e4m3 block scales, power-of-two global scale."""
    rows = draw(st.integers(1, 6))
    nblocks = draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    codes = torch.randint(0, 16, (rows, 16 * nblocks), generator=gen, dtype=torch.uint8)
    codes[:, ::16] = torch.where(torch.rand(rows, nblocks, generator=gen) < 0.5, 7, 15).to(
        torch.uint8
    )
    bs = torch.randint(
        0x08, 0x7F, (rows, nblocks), generator=gen, dtype=torch.uint8
    )  # normal, < NaN
    gs = torch.tensor(2.0 ** draw(st.integers(-60, 60)))
    packed = pack_e2m1(codes)
    return packed, bs.view(torch.float8_e4m3fn), gs, dequantize_nvfp4(packed, bs, gs, torch.float32)


@HYP
@given(representable_nvfp4())
def test_round_trip_bit_exact_with_pinned_global_scale(case) -> None:
    packed, bs, gs, w = case
    q = quantize_nvfp4(w, weight_scale_2=gs)
    assert torch.equal(q.weight, packed)
    assert torch.equal(q.weight_scale.view(torch.uint8), bs.view(torch.uint8))
    assert q.weight_scale_2.item() == gs.item()


@HYP
@given(st.integers(1, 8), st.integers(1, 80), st.floats(-30, 30), st.integers(0, 2**31 - 1))
def test_random_error_bound(rows: int, half_k: int, log_scale: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    k = 2 * half_k
    # Per-row spread so some blocks sit far below the global amax: their e4m3 block scales are
    # subnormal or round to 0.
    w = torch.randn(rows, k, generator=gen) * 2.0**log_scale
    w = w * torch.exp2(-24 * torch.rand(rows, 1, generator=gen))
    q = quantize_nvfp4(w)
    back = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, torch.float32)
    gs = q.weight_scale_2
    step = e4m3_to_float(q.weight_scale).repeat_interleave(16, -1)[:, :k] * gs
    # Half a grid step (1/4 relative) plus what a block scale rounded to e4m3 0 or subnormal loses.
    bound = 0.25 * torch.maximum(w.abs(), step) + 6 * gs * 2.0**-10
    assert bool(((back - w).abs() <= bound * (1 + 1e-6)).all())


@HYP
@given(st.integers(1, 8), st.integers(1, 80), st.floats(-30, 30), st.integers(0, 2**31 - 1))
def test_requantize_is_lossless(rows: int, half_k: int, log_scale: float, seed: int) -> None:
    # With normal e4m3 block scales every block's largest element lands on code +-6, so quantizing
    # the dequantized weight again with the same global scale gives the same values back.
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 2 * half_k, generator=gen) * 2.0**log_scale
    q = quantize_nvfp4(w)
    gs = q.weight_scale_2
    back = dequantize_nvfp4(q.weight, q.weight_scale, gs, torch.float32)
    q2 = quantize_nvfp4(back, weight_scale_2=gs)
    assert torch.equal(dequantize_nvfp4(q2.weight, q2.weight_scale, gs, torch.float32), back)


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def test_nvfp4_checkpoint_round_trip(tmp_path: Path) -> None:
    """A tiny NVFP4 checkpoint (nvidia/DeepSeek-V4-Flash-NVFP4 layout, reference §7)."""
    hidden, inter = 128, 96
    gen = torch.Generator().manual_seed(11)
    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for e in range(2):
        for proj, shape in (
            ("w1", (inter, hidden)),
            ("w3", (inter, hidden)),
            ("w2", (hidden, inter)),
        ):
            name = f"layers.5.ffn.experts.{e}.{proj}.weight"
            q = quantize_nvfp4(
                torch.randn(*shape, generator=gen) * 0.05, input_scale=0.125 * (e + 1)
            )
            companions = scale_names_for(name, "nvfp4")
            tensors[name] = q.weight
            tensors[companions["weight_scale"]] = q.weight_scale
            tensors[companions["weight_scale_2"]] = q.weight_scale_2
            tensors[companions["input_scale"]] = q.input_scale
            reference[name] = dequantize_nvfp4(
                q.weight, q.weight_scale, q.weight_scale_2, torch.float32
            )
    # What stays as in the native checkpoint: mtp experts in MXFP4, attention weights in FP8.
    mtp = "mtp.0.ffn.experts.0.w1.weight"
    packed, scales = quantize_mxfp4(torch.randn(inter, hidden, generator=gen))
    tensors[mtp], tensors[scale_name_for(mtp, "mxfp4")] = packed, scales
    attn = "layers.5.attn.wq_a.weight"
    fq, fs = quantize_fp8_block(torch.randn(64, hidden, generator=gen))
    tensors[attn], tensors[scale_name_for(attn, "fp8_block")] = fq, fs
    path = tmp_path / "model-00001-of-00001.safetensors"
    save_file(tensors, str(path))

    header = _header(path)
    assert header["layers.5.ffn.experts.0.w1.weight"]["dtype"] == "U8"
    assert header["layers.5.ffn.experts.0.w1.weight"]["shape"] == [inter, hidden // 2]
    assert header["layers.5.ffn.experts.0.w1.weight_scale"]["dtype"] == "F8_E4M3"
    assert header["layers.5.ffn.experts.0.w1.weight_scale"]["shape"] == [inter, hidden // 16]
    assert header["layers.5.ffn.experts.1.w2.weight_scale"]["shape"] == [hidden, inter // 16]
    for leaf in ("weight_scale_2", "input_scale"):
        meta = header[f"layers.5.ffn.experts.1.w3.{leaf}"]
        assert meta["dtype"] == "F32" and meta["shape"] == []
    assert (
        header[mtp]["dtype"] == "I8"
        and header["mtp.0.ffn.experts.0.w1.scale"]["dtype"] == "F8_E8M0"
    )
    assert f"{mtp[: -len('weight')]}weight_scale_2" not in header

    with safe_open(str(path), "pt") as f:
        for name, ref in reference.items():
            base = name[: -len("weight")]
            got = dequantize_nvfp4(
                f.get_tensor(name),
                f.get_tensor(scale_name_for(name, "nvfp4")),
                f.get_tensor(base + "weight_scale_2"),
                torch.float32,
            )
            assert torch.equal(got, ref), name
        assert f.get_tensor("layers.5.ffn.experts.1.w2.input_scale").item() == 0.25
        assert torch.equal(
            dequantize_mxfp4(
                f.get_tensor(mtp), f.get_tensor("mtp.0.ffn.experts.0.w1.scale"), torch.float32
            ),
            dequantize_mxfp4(packed, scales, torch.float32),
        )
        assert torch.equal(
            dequantize_fp8_block(f.get_tensor(attn), f.get_tensor("layers.5.attn.wq_a.scale")),
            dequantize_fp8_block(fq, fs),
        )
        # Nibble order survives the file: element 0 is the low nibble of byte 0.
        raw = f.get_tensor("layers.5.ffn.experts.0.w1.weight")
        assert torch.equal(unpack_e2m1(raw)[:, 0], raw[:, 0] & 0xF)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(4, 96, 200, generator=gen) * torch.logspace(-8, 8, 200, base=2.0)
    q = quantize_nvfp4(w)
    qc = quantize_nvfp4(w.cuda())
    assert torch.equal(qc.weight.cpu(), q.weight)
    assert torch.equal(qc.weight_scale.cpu().view(torch.uint8), q.weight_scale.view(torch.uint8))
    assert torch.equal(qc.weight_scale_2.cpu(), q.weight_scale_2)
    got = dequantize_nvfp4(qc.weight, qc.weight_scale, qc.weight_scale_2, torch.float32)
    assert torch.equal(
        got.cpu(), dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, torch.float32)
    )
