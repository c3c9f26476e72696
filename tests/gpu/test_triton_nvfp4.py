"""The Triton NVFP4 dequantization against the torch reference, bit for bit, on fresh random
bytes (every e2m1 code, random e4m3 scales, one global scale per matrix).

Quick tier (`pytest -m gpu`): bf16 at an expert's shape, fp32 at a ragged one, NaN scales, bad
shapes, experts on the GPU; gpu_full (`pytest -m gpu_full`): the other shape x dtype cases."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiered

from kvrelay.kernels.triton_nvfp4 import dequantize_nvfp4
from kvrelay.models.deepseek_v4 import preset
from kvrelay.models.deepseek_v4.experts import Fp4Experts
from kvrelay.quant.nvfp4 import dequantize_nvfp4 as reference

pytestmark = pytest.mark.gpu


def _random(lead: tuple[int, ...], n: int, k: int, gen: torch.Generator, nan: bool = False):
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(0, 256, (*lead, n, k // 16), dtype=torch.uint8, generator=gen)
    if not nan:  # 0x7F / 0xFF are e4m3's NaN
        scale[(scale & 0x7F) == 0x7F] = 0x38  # 1.0
    gs = torch.rand(lead or (1,), generator=gen) * 1e-2 + 1e-4
    return packed, scale.view(torch.float8_e4m3fn), gs.reshape(lead) if lead else gs[0]


@tiered(
    "lead,n,k,dtype",
    [
        (*s, d)
        for d, s in itertools.product(
            (torch.bfloat16, torch.float32),
            [((), 1, 16), ((3,), 64, 80), ((2,), 256, 4096), ((2, 2), 33, 2064)],
        )
    ],
    quick=[((2,), 256, 4096, torch.bfloat16), ((2, 2), 33, 2064, torch.float32)],
    ids=lambda c: f"{'x'.join(map(str, (*c[0], c[1], c[2])))}-{str(c[3])[6:]}",
)
def test_bit_identical_to_the_torch_reference(lead, n, k, dtype) -> None:
    gen = torch.Generator().manual_seed(hash((lead, n, k)) % 2**31)
    for _ in range(2):  # fresh bytes each time
        packed, scale, gs = _random(lead, n, k, gen)
        want = reference(packed, scale, gs, dtype)
        got = dequantize_nvfp4(packed.cuda(), scale.cuda(), gs.cuda(), dtype)
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.equal(got.cpu(), want)  # every element written, exactly


def test_nan_scales_give_nan_where_the_reference_does() -> None:
    packed, scale, gs = _random((2,), 16, 64, torch.Generator().manual_seed(1), nan=True)
    want = reference(packed, scale, gs, torch.float32)
    got = dequantize_nvfp4(packed.cuda(), scale.cuda(), gs.cuda(), torch.float32).cpu()
    assert want.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_bad_shapes_raise() -> None:
    packed, scale, gs = _random((2,), 8, 32, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_nvfp4(packed.cuda(), scale[..., :1].cuda(), gs.cuda())
    with pytest.raises(ValueError, match="3 global scales for 2 matrices"):
        dequantize_nvfp4(packed.cuda(), scale.cuda(), torch.ones(3, device="cuda"))


def test_fp4_experts_on_gpu_equal_the_cpu_path() -> None:
    cfg = preset("dsv4-tiny").with_(expert_format="nvfp4")
    cpu = Fp4Experts(cfg, torch.bfloat16)
    cpu.init_dummy(torch.Generator().manual_seed(4))
    with torch.no_grad():  # random block scales and per-matrix global scales, not the dummy's 1s
        for s in (cpu.gate_up_scale, cpu.down_scale):
            s.copy_((torch.rand(s.shape) * 4 + 0.1).to(torch.float8_e4m3fn))
        cpu.gate_up_scale_2.uniform_(0.01, 0.1)
        cpu.down_scale_2.uniform_(0.01, 0.1)
    gpu = Fp4Experts(cfg, torch.bfloat16).cuda()
    gpu.load_state_dict(cpu.state_dict())
    for e in range(cfg.n_routed_experts):
        for a, b in zip(gpu.expert_weights(e), cpu.expert_weights(e), strict=True):
            assert torch.equal(a.cpu(), b), e
