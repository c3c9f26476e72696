"""Routed experts: clamped SwiGLU over stacked weights, kept dense (HF layout: gate and up
fused, gate first) or packed in NVFP4 (NVIDIA's checkpoints) or MXFP4 (DeepSeek's own) and
dequantized one expert at a time when a token routes to it (the torch reference for the FP4
grouped-GEMM kernels, and how a DeepSeek-V4-sized model fits one GPU)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.models.deepseek_v4.config import DeepseekV4Config
from kvrelay.models.deepseek_v4.precision import wide
from kvrelay.quant.mxfp4 import MXFP4_BLOCK, dequantize_mxfp4
from kvrelay.quant.nvfp4 import NVFP4_BLOCK
from kvrelay.quant.nvfp4 import dequantize_nvfp4 as _torch_dequant

EXPERT_FORMATS = ("dense", "nvfp4", "mxfp4")
E2M1_RMS = 2.93  # RMS of uniformly drawn e2m1 codes: dummy scales give fan-in-scaled weights


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); limit <= 0 disables the clamp."""
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class Experts(nn.Module):
    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h, dtype=dtype))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i, dtype=dtype))

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, hidden], down [hidden, I]) of expert e."""
        return self.gate_up_proj[e], self.down_proj[e]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], x.shape[1], dtype=weights.dtype, device=x.device)
        for e in idx.unique().tolist():
            if e < 0:  # expert parallel: another rank's expert
                continue
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            w_gate_up, w_down = self.expert_weights(e)
            gate, up = wide(F.linear(x[tok], w_gate_up)).chunk(2, dim=-1)
            # the reference scales by the routing weight before the down projection
            act = clamped_swiglu(gate, up, self.limit) * weights[tok, slot][:, None]
            out.index_add_(0, tok, wide(F.linear(act.to(x.dtype), w_down)).to(out.dtype))
        return out


class QuantizedExperts(Experts):
    """Experts whose weights stay packed 4-bit codes plus scales (`fp4_format` names the
    encoding); `expert_weights` dequantizes one expert."""

    fp4_format = ""

    def _start(self, config: DeepseekV4Config, dtype: torch.dtype, block: int) -> tuple:
        """The shared part of the constructors: (experts, hidden, intermediate)."""
        nn.Module.__init__(self)
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        if h % block or i % block:
            raise ValueError(
                f"{self.fp4_format} experts need hidden and intermediate sizes divisible by {block}"
            )
        self.limit, self.dtype = config.swiglu_limit, dtype
        return e, h, i

    @staticmethod
    def _random_codes(packed: torch.Tensor, generator: torch.Generator) -> None:
        packed.copy_(torch.randint(0, 256, packed.shape, generator=generator, device=packed.device))

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert dequantized: (gate_up [E, 2I, hidden], down [E, hidden, I]), the
        layout of `Experts` (tests and conversions; the forward dequantizes per expert)."""
        pairs = [self.expert_weights(e) for e in range(self.gate_up_packed.shape[0])]
        return torch.stack([g for g, _ in pairs]), torch.stack([d for _, d in pairs])


class Fp4Experts(QuantizedExperts):
    """w = e2m1 * e4m3 scale (per 16 inputs) * fp32 global scale; gate, up and down each carry
    their own global scale, as NVIDIA's checkpoints do."""

    fp4_format = "nvfp4"

    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32) -> None:
        e, h, i = self._start(config, dtype, NVFP4_BLOCK)

        def buf(name: str, *shape: int, dt: torch.dtype) -> None:
            self.register_buffer(name, torch.zeros(*shape, dtype=dt))

        buf("gate_up_packed", e, 2 * i, h // 2, dt=torch.uint8)
        buf("gate_up_scale", e, 2 * i, h // NVFP4_BLOCK, dt=torch.float8_e4m3fn)
        buf("gate_up_scale_2", e, 2, dt=torch.float32)  # gate, up
        buf("down_packed", e, h, i // 2, dt=torch.uint8)
        buf("down_scale", e, h, i // NVFP4_BLOCK, dt=torch.float8_e4m3fn)
        buf("down_scale_2", e, dt=torch.float32)

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        halves = (2, self.gate_up_packed.shape[1] // 2, -1)
        # On the GPU one Triton pass per matrix, bit-identical to the torch reference.
        dequantize_nvfp4 = _triton_dequant if self.gate_up_packed.is_cuda else _torch_dequant
        gate_up = dequantize_nvfp4(
            self.gate_up_packed[e].view(halves),
            self.gate_up_scale[e].view(halves),
            self.gate_up_scale_2[e],
            self.dtype,
        ).flatten(0, 1)
        down = dequantize_nvfp4(
            self.down_packed[e], self.down_scale[e], self.down_scale_2[e], self.dtype
        )
        return gate_up, down

    @torch.no_grad()
    def init_dummy(self, generator: torch.Generator) -> None:
        """Random codes, unit block scales, and a global scale giving fan-in-scaled weights
        (uniformly drawn e2m1 codes have an RMS of about 2.93)."""
        for packed, scale, scale_2 in (
            (self.gate_up_packed, self.gate_up_scale, self.gate_up_scale_2),
            (self.down_packed, self.down_scale, self.down_scale_2),
        ):
            self._random_codes(packed, generator)
            scale.fill_(1.0)
            scale_2.fill_(1.0 / (E2M1_RMS * (2 * packed.shape[-1]) ** 0.5))


class Mxfp4Experts(QuantizedExperts):
    """w = e2m1 * 2^(e8m0 byte - 127), one power-of-two scale per 32 inputs and no global scale:
    DeepSeek's native routed experts. Scales are kept as their raw bytes (uint8)."""

    fp4_format = "mxfp4"

    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32) -> None:
        e, h, i = self._start(config, dtype, MXFP4_BLOCK)
        u8 = torch.uint8
        self.register_buffer("gate_up_packed", torch.zeros(e, 2 * i, h // 2, dtype=u8))
        self.register_buffer("gate_up_scale", torch.zeros(e, 2 * i, h // MXFP4_BLOCK, dtype=u8))
        self.register_buffer("down_packed", torch.zeros(e, h, i // 2, dtype=u8))
        self.register_buffer("down_scale", torch.zeros(e, h, i // MXFP4_BLOCK, dtype=u8))

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            dequantize_mxfp4(self.gate_up_packed[e], self.gate_up_scale[e], self.dtype),
            dequantize_mxfp4(self.down_packed[e], self.down_scale[e], self.dtype),
        )

    @torch.no_grad()
    def init_dummy(self, generator: torch.Generator) -> None:
        """Random codes and the power-of-two scale nearest to fan-in scaling."""
        for packed, scale in (
            (self.gate_up_packed, self.gate_up_scale),
            (self.down_packed, self.down_scale),
        ):
            self._random_codes(packed, generator)
            exponent = round(-math.log2(E2M1_RMS * (2 * packed.shape[-1]) ** 0.5))
            scale.fill_(127 + exponent)


def _triton_dequant(*args) -> torch.Tensor:
    from kvrelay.kernels.triton_nvfp4 import dequantize_nvfp4

    return dequantize_nvfp4(*args)


def make_experts(config: DeepseekV4Config, dtype: torch.dtype) -> Experts:
    if config.expert_format == "nvfp4":
        return Fp4Experts(config, dtype)
    if config.expert_format == "mxfp4":
        return Mxfp4Experts(config, dtype)
    return Experts(config, dtype)
