from __future__ import annotations

import inspect
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
    decode_e2m1,
    dequantize_fp8_block,
    dequantize_mxfp4,
    encode_ue8m0,
    expert_slot,
    pack_e2m1,
    quantize_fp8_block,
    quantize_mxfp4,
    scale_name_for,
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
HYP = settings(max_examples=40, deadline=None)


@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_hand_example(device: str) -> None:
    # One row, K = 64: two blocks of 32. Block 0 scale byte 127 (x1), block 1 byte 129 (x4).
    packed = torch.zeros(1, 32, dtype=torch.uint8)
    packed[0, 0] = 0x21  # elements 0, 1: codes 1, 2 -> 0.5, 1.0
    packed[0, 15] = 0xF7  # elements 30, 31: codes 7, 15 -> 6, -6
    packed[0, 16] = 0x9A  # elements 32, 33: codes 10, 9 -> -1, -0.5 (then x4)
    packed[0, 31] = 0x53  # elements 62, 63: codes 3, 5 -> 1.5, 3 (then x4)
    scales = torch.tensor([[127, 129]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = dequantize_mxfp4(packed.view(torch.int8).to(device), scales.to(device), torch.float32)
    expected = torch.zeros(1, 64)
    expected[0, [0, 1, 30, 31]] = torch.tensor([0.5, 1.0, 6.0, -6.0])
    expected[0, [32, 33, 62, 63]] = torch.tensor([-4.0, -2.0, 6.0, 12.0])
    assert torch.equal(got.cpu(), expected)
    assert dequantize_mxfp4(packed, scales).dtype == torch.bfloat16


def test_scale_forms_and_nan_scale() -> None:
    gen = torch.Generator().manual_seed(1)
    packed = torch.randint(-128, 128, (4, 48), generator=gen, dtype=torch.int8)
    b = torch.randint(100, 150, (4, 3), generator=gen, dtype=torch.uint8)
    ref = dequantize_mxfp4(packed, b.view(torch.float8_e8m0fnu), torch.float32)
    assert torch.equal(dequantize_mxfp4(packed, b, torch.float32), ref)
    assert torch.equal(dequantize_mxfp4(packed, ue8m0_to_float(b), torch.float32), ref)
    b[2, 1] = 255
    got = dequantize_mxfp4(packed, b, torch.float32)
    assert got[2, 32:64].isnan().all() and int(got.isnan().sum()) == 32


def test_shape_checks() -> None:
    with pytest.raises(ValueError, match="scales shape"):
        dequantize_mxfp4(torch.zeros(4, 48, dtype=torch.int8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError):
        quantize_mxfp4(torch.zeros(4, 33))
    with pytest.raises(ValueError, match="NaN or infinity"):
        quantize_mxfp4(torch.full((2, 32), float("inf")))


def test_quantize_layout_matches_checkpoint() -> None:
    # A scaled-down w1: logical [N, K] -> I8 [N, K/2] + F8_E8M0 [N, K/32] (reference §6).
    w = torch.randn(64, 256)
    packed, scales = quantize_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (64, 128)
    assert scales.dtype == torch.float8_e8m0fnu and scales.shape == (64, 8)
    assert quantize_mxfp4(w, "uint8", torch.uint8)[1].dtype == torch.uint8
    zero_block = quantize_mxfp4(torch.zeros(1, 32), "uint8")
    assert zero_block[1].tolist() == [[127]] and not zero_block[0].any()


def test_partial_last_block() -> None:
    w = torch.zeros(2, 40)  # blocks of 32 and 8
    w[0, 35] = 12.0  # block 1: 12/6 = 2 -> scale 2, code 7
    w[1, 3] = -0.75  # block 0: 0.75/6 -> 2^-3; -0.75 * 8 = -6
    packed, scales = quantize_mxfp4(w, "uint8")
    assert packed.shape == (2, 20) and scales.tolist() == [[127, 128], [124, 127]]
    assert unpack_e2m1(packed)[0, 35].item() == 7 and unpack_e2m1(packed)[1, 3].item() == 15
    assert torch.equal(dequantize_mxfp4(packed, scales, torch.float32), w)


@st.composite
def representable_mxfp4(draw, canonical: bool):
    rows = draw(st.integers(1, 6))
    nblocks = draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    codes = torch.randint(0, 16, (rows, 32 * nblocks), generator=gen, dtype=torch.uint8)
    if canonical:
        codes[:, ::32] = torch.where(torch.rand(rows, nblocks, generator=gen) < 0.5, 7, 15).to(
            torch.uint8
        )
    scales = encode_ue8m0(torch.randint(-110, 110, (rows, nblocks), generator=gen), "uint8")
    packed = pack_e2m1(codes)
    return packed, scales, dequantize_mxfp4(packed, scales, torch.float32)


@HYP
@given(representable_mxfp4(canonical=True))
def test_round_trip_bit_exact_on_canonical_blocks(case) -> None:
    packed, scales, w = case
    p2, s2 = quantize_mxfp4(w, "uint8", torch.uint8)
    assert torch.equal(p2, packed) and torch.equal(s2, scales)


@HYP
@given(representable_mxfp4(canonical=False))
def test_round_trip_values_exact_on_representable(case) -> None:
    _, _, w = case
    back = dequantize_mxfp4(*quantize_mxfp4(w), torch.float32)
    assert torch.equal(back, w) and torch.equal(back.signbit(), w.signbit())


@HYP
@given(st.integers(1, 8), st.integers(1, 100), st.floats(-40, 40), st.integers(0, 2**31 - 1))
def test_random_error_bound(rows: int, half_k: int, log_scale: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    k = 2 * half_k
    w = torch.randn(rows, k, generator=gen) * 2.0**log_scale
    packed, scales = quantize_mxfp4(w)
    back = dequantize_mxfp4(packed, scales, torch.float32)
    step = ue8m0_to_float(scales).repeat_interleave(32, -1)[:, :k]
    assert bool(((back - w).abs() <= 0.25 * torch.maximum(w.abs(), step)).all())
    # Idempotent: quantizing the dequantized weight changes nothing.
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(back), torch.float32), back)


def test_matches_hf_transformers_fp4_dequant() -> None:
    """Independent oracle: HF transformers' FP4 expert dequantization (same nibble order)."""
    fg = pytest.importorskip("transformers.integrations.finegrained_fp8")
    deq = getattr(getattr(fg, "Fp8Dequantize", None), "_dequantize_one", None)
    # A private helper of transformers 5.24: skip where it is missing or shaped differently.
    if (
        deq is None
        or "output_dtype" not in inspect.signature(deq).parameters
        or not hasattr(fg.Fp8Dequantize, "_unpack_fp4")
    ):
        pytest.skip("this transformers version has no matching Fp8Dequantize._dequantize_one")
    packed, scales = quantize_mxfp4(torch.randn(96, 128))
    ours = dequantize_mxfp4(packed, scales, torch.float32)
    assert torch.equal(
        deq(fg.Fp8Dequantize(None), packed, scales, output_dtype=torch.float32), ours
    )


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def test_native_checkpoint_round_trip(tmp_path: Path) -> None:
    """A tiny DeepSeek-native checkpoint: two MXFP4 routed experts and an FP8 shared expert."""
    hidden, inter = 256, 160  # fp8 grid over inter = 160 has a partial block
    gen = torch.Generator().manual_seed(7)
    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    originals: dict[str, torch.Tensor] = {}
    for e in range(2):
        for proj, shape in (
            ("w1", (inter, hidden)),
            ("w3", (inter, hidden)),
            ("w2", (hidden, inter)),
        ):
            name = f"layers.3.ffn.experts.{e}.{proj}.weight"
            w = torch.randn(*shape, generator=gen) * 0.02
            packed, scales = quantize_mxfp4(w)
            tensors[name] = packed
            tensors[scale_name_for(name, "mxfp4")] = scales
            reference[name] = dequantize_mxfp4(packed, scales, torch.float32)
            originals[name] = w
    for proj, shape in (("w1", (inter, hidden)), ("w2", (hidden, inter))):
        name = f"layers.3.ffn.shared_experts.{proj}.weight"
        w = torch.randn(*shape, generator=gen) * 0.02
        q, s = quantize_fp8_block(w)
        tensors[name], tensors[scale_name_for(name, "fp8_block")] = q, s
        reference[name] = dequantize_fp8_block(q, s, dtype=torch.float32)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))

    header = _header(path)
    w1 = header["layers.3.ffn.experts.1.w1.weight"]
    assert w1["dtype"] == "I8" and w1["shape"] == [inter, hidden // 2]
    w1_scale = header["layers.3.ffn.experts.1.w1.scale"]
    assert w1_scale["dtype"] == "F8_E8M0" and w1_scale["shape"] == [inter, hidden // 32]
    assert header["layers.3.ffn.experts.0.w2.weight"]["shape"] == [hidden, inter // 2]
    assert header["layers.3.ffn.experts.0.w2.scale"]["shape"] == [hidden, inter // 32]
    assert header["layers.3.ffn.shared_experts.w1.weight"]["dtype"] == "F8_E4M3"
    assert header["layers.3.ffn.shared_experts.w1.scale"]["dtype"] == "F8_E8M0"
    assert header["layers.3.ffn.shared_experts.w1.scale"]["shape"] == [2, 2]

    with safe_open(str(path), "pt") as f:
        for name, ref in reference.items():
            weight = f.get_tensor(name)
            if ".experts." in name and "shared" not in name:
                got = dequantize_mxfp4(
                    weight, f.get_tensor(scale_name_for(name, "mxfp4")), torch.float32
                )
                bound = 0.25 * originals[name].abs().amax()
                assert (got - originals[name]).abs().max() <= bound
            else:
                got = dequantize_fp8_block(
                    weight, f.get_tensor(scale_name_for(name, "fp8_block")), dtype=torch.float32
                )
            assert torch.equal(got, ref), name

        # Assemble HF's fused gate_up_proj for the layer from the native file via expert_slot.
        fused = torch.empty(2, 2 * inter, hidden)
        for e in range(2):
            for proj in ("w1", "w3"):
                name = f"layers.3.ffn.experts.{e}.{proj}.weight"
                slot = expert_slot(name)
                assert (
                    slot is not None and slot.hf_name == "model.layers.3.mlp.experts.gate_up_proj"
                )
                rows = slice(slot.part * inter, (slot.part + 1) * inter)
                fused[slot.expert, rows] = dequantize_mxfp4(
                    f.get_tensor(name), f.get_tensor(scale_name_for(name, "mxfp4")), torch.float32
                )
        assert torch.equal(fused[1, :inter], reference["layers.3.ffn.experts.1.w1.weight"])
        assert torch.equal(fused[1, inter:], reference["layers.3.ffn.experts.1.w3.weight"])


def test_decode_matches_lut_formula() -> None:
    # The reference's formula: LUT[code & 7] * (-1)^(code >> 3) * 2^(e - 127).
    lut = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    codes = torch.arange(16, dtype=torch.uint8)
    want = torch.tensor([lut[c & 7] * (-1) ** (c >> 3) for c in range(16)], dtype=torch.float32)
    assert torch.equal(decode_e2m1(codes), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(4, 96, 200, generator=gen) * torch.logspace(-30, 30, 200, base=2.0)
    packed, scales = quantize_mxfp4(w)
    pc, sc = quantize_mxfp4(w.cuda())
    assert torch.equal(pc.cpu(), packed) and torch.equal(
        sc.cpu().view(torch.uint8), scales.view(torch.uint8)
    )
    assert torch.equal(dequantize_mxfp4(pc, sc).cpu(), dequantize_mxfp4(packed, scales))
