"""Dense PD with a tensor-parallel decode side == one TP=1 server: prefill TP=1 sends
whole KV rows; decode's rank 0 receives them and hands each piece to rank 1, and each rank keeps
its KV-head shard (engine/tp_install.py, `CacheKind.shard`).

qwen3-tiny (dummy weights, float32 on the CPU, 2 KV heads: 1 per rank); prefill runs 64-token
chunks, so the longer prompts travel in several pieces. Greedy text must be identical; logprobs
agree within 1e-4 (TP sums float32 partial sums in another order than one rank).
"""

from __future__ import annotations

import pytest
from openai_calls import assert_same_outputs, run_specs
from pd_stack import PDStack

from kvrelay.config import DisaggConfig, EngineConfig
from kvrelay.engine.tp_worker import check_supported
from kvrelay.weights.loader import resolve

MODEL = "qwen3-tiny"
SERVE = ("--model", MODEL, "--load-format", "dummy", "--device", "cpu", "--dtype", "float32")
STORY = "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps. "


@pytest.fixture(scope="module")
def pd():
    stack = PDStack(decode_args=("--tensor-parallel-size", "2"), max_total_tokens=4096, model=SERVE)
    yield stack
    stack.close()


def test_pd_with_tp2_decode_matches_single_server(pd):
    """The reference is prefill's own TP=1 server answering plain requests (no PD fields: it
    runs them whole, as a single server does): one server fewer to start."""
    prompts = ["Hello there", STORY * 4, STORY * 9 + "1, 2, 3,"]  # up to ~170 tokens
    specs = [
        {"kind": "completion", "prompt": p, "stream": i == 1, "max_tokens": 12, "logprobs": 2}
        for i, p in enumerate(prompts)
    ]
    want = run_specs(pd.prefill.url, MODEL, specs)
    got = run_specs(pd.router.url, MODEL, specs)
    assert_same_outputs(specs, want, got, rel=1e-4, abs=1e-4)
    assert all(r["text"] for r in want)
    pd.wait_idle()
    assert pd.router.metric("kvrelay_router_requests_total", '{outcome="error"}') == 0


@pytest.mark.parametrize(
    "role, backend, why",
    [
        ("prefill", "tcp", "single and decode roles only"),
        ("decode", "cuda_ipc", "needs --transfer-backend tcp"),
    ],
)
def test_unsupported_dense_tp_roles_are_refused(role: str, backend: str, why: str):
    """Rank 0 holds only its KV heads: it cannot send a prefill's cache whole, and cuda_ipc would
    write whole rows into its pages."""
    cfg = EngineConfig(
        model=MODEL,
        load_format="dummy",
        role=role,
        tensor_parallel_size=2,
        disagg=DisaggConfig(transfer_backend=backend),
    )
    with pytest.raises(ValueError, match=why):
        check_supported(cfg, resolve(MODEL, "dummy", None))
