"""Which implementation of the small per-token ops a model runs: torch (CPU, the reference and
the oracle) or Triton (GPU: one launch per op)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.kernels import reference


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable
    apply_rope: Callable
    silu_and_mul: Callable


TORCH_OPS = Ops(reference.rms_norm, reference.apply_rope, reference.silu_and_mul)


def triton_ops() -> Ops:
    from kvrelay.kernels import triton_pointwise as t

    return Ops(t.rms_norm, t.apply_rope, t.silu_and_mul)
