"""DeepSeek-V4 rotary embedding: interleaved pairs on the trailing dims, optional YaRN, magnitude 1."""

from __future__ import annotations

import math

import torch

from kvrelay.models.deepseek_v4.config import SLIDING, DeepseekV4Config
from kvrelay.models.deepseek_v4.fusion import fusable
from kvrelay.models.deepseek_v4.precision import wide, wide_dtype


def rope_inv_freq(
    dim: int,
    base: float,
    factor: float = 1.0,
    original_max_position: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """[dim // 2] fp64 inverse frequencies; with factor > 1 the YaRN ramp blends freq/factor
    (low frequencies) with freq (high frequencies)."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if factor <= 1.0:
        return freqs

    def corr_dim(rotations: float) -> float:
        return (
            dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))
        )

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp)


class RopeTable:
    """Angles for one layer kind. Not an nn.Module buffer on purpose: casting the model to bf16
    must not round the frequencies."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq.to(torch.float64)
        self.key = tuple(self.inv_freq.tolist())  # equal tables share a step's cos/sin
        # per (device, dtype): copied once, so a CUDA graph capture finds no host copy to do
        self._on_device: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    @classmethod
    def for_layer(cls, config: DeepseekV4Config, layer_type: str) -> RopeTable:
        dim = config.qk_rope_head_dim
        if layer_type == SLIDING:
            return cls(rope_inv_freq(dim, config.rope_theta))
        return cls(
            rope_inv_freq(
                dim,
                config.compress_rope_theta,
                config.rope_factor,
                config.rope_original_max_position,
                config.rope_beta_fast,
                config.rope_beta_slow,
            )
        )

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [n, dim // 2]. Angles are formed in fp32 like the reference (fp64
        for a model that runs in fp64)."""
        wdt = wide_dtype(dtype)
        key = (positions.device, wdt)
        if key not in self._on_device:
            self._on_device[key] = self.inv_freq.to(device=positions.device, dtype=wdt)
        inv = self._on_device[key]
        angles = positions.to(wdt)[:, None] * inv[None, :]
        return angles.cos(), angles.sin()


@fusable
def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] dims of x as interleaved (even, odd) pairs.

    x: [n, ..., D]; cos/sin: [n, dim // 2]. `inverse` rotates by the conjugate angle.
    """
    rd = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    if inverse:
        s = -s
    rope = wide(x[..., -rd:]).unflatten(-1, (-1, 2))
    a, b = rope[..., 0], rope[..., 1]
    rotated = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)
