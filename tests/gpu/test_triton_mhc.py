"""The fused mHC gates kernel against HyperConnection.gates (torch) on fresh random inputs
(quick tier: 1 and 300 tokens; gpu_full: the others)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiered

from kvrelay.kernels.triton_mhc import hc_gates
from kvrelay.models.deepseek_v4.mhc import HyperConnection

pytestmark = pytest.mark.gpu


@tiered("t", [1, 7, 33, 300], quick=[1, 300])
def test_gates_equal_the_torch_reference(t: int) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hc = HyperConnection(4, 64, 20, 1e-6, 1e-6).to(dev)
    for _ in range(2):  # fresh draws each time
        with torch.no_grad():
            hc.base.normal_()
            hc.scale.uniform_(0.5, 2.0)
        mix = torch.randn(t, 24, device=dev) * 3
        want = hc.gates(mix)
        got = hc_gates(mix, hc.scale, hc.base, 4, 20, 1e-6)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (g - w).abs().max()
