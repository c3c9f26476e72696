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
from conftest import smollm2_tokenizer_args

sys.path.insert(0, str(Path(__file__).parents[1] / "disagg"))
from openai_calls import client  # noqa: E402
from pd_stack import bootstrap_events, metrics, single_beside_pd  # noqa: E402

pytestmark = pytest.mark.gpu
pytest.importorskip("nixl_cu13", reason="NIXL is not installed (PART=nixl carries a slim wheel)")

GPU = ("--device", "cuda", "--dtype", "float32", "--max-total-tokens", "16384")
STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
    "listening to the sea, and writing the weather into a leather notebook. "
)


def test_pd_over_nixl_in_vram_equals_a_single_server():
    tokenizer = smollm2_tokenizer_args()
    if tokenizer is None:
        pytest.skip("no SmolLM2 tokenizer: run scripts/gpu_wheels.sh (.whl/tokenizer-smollm2)")
    model = ("--model", "smollm2-135m", "--load-format", "dummy", *tokenizer)
    side = (*GPU, "--transfer-backend", "nixl")
    single, pd = single_beside_pd(model, (*GPU, "--max-num-batched-tokens", "64"), side)
    try:
        for prompt in ("The capital of France is", STORY * 3, STORY * 9):
            kw = dict(model="smollm2-135m", prompt=prompt, max_tokens=16, temperature=0)
            want = client(single.url).completions.create(**kw).choices[0]
            got = client(pd.router.url).completions.create(**kw).choices[0]
            assert (got.text, got.finish_reason) == (want.text, want.finish_reason), prompt[:40]
        pd.wait_idle()
        sent = metrics(pd.prefill.url)
        assert sent['kvrelay_pd_transfer_bytes_total{backend="nixl",direction="sent"}'] > 0
        assert sent.get('kvrelay_pd_transfer_bytes_total{backend="tcp",direction="sent"}', 0) == 0
        for s in (pd.prefill, pd.decode):
            events = bootstrap_events(s.url)
            assert events.get("peer_connected") == 1, events
            assert not any(events.get(e) for e in ("ipc_open_failed", "layout_mismatch")), events
    finally:
        pd.close()
        single.close()
