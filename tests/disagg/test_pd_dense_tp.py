"""Dense PD with tensor parallel on either side == one TP=1 server. Whole KV rows travel: a TP=1
prefill reads them from its pool; a TP=2 prefill's rank 0 gathers every rank's KV heads first
(engine/tp_gather.py). A TP=2 decode's rank 0 receives them and hands each piece to rank 1, and
each rank keeps its KV-head shard (engine/tp_install.py, `CacheKind.shard`). Pairs: prefill TP=1
-> decode TP=2, prefill TP=2 -> decode TP=1, prefill TP=2 -> decode TP=2.

qwen3-tiny (dummy weights, float32 on the CPU, 2 KV heads: 1 per rank); prefill runs 64-token
chunks, so the longer prompts travel in several pieces. Greedy text must be identical; logprobs
agree within 1e-4 (TP sums float32 partial sums in another order than one rank).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ServerProcess
from openai_calls import assert_same_outputs, run_specs
from pd_stack import PD_SECRET, PDStack, RouterProcess, engine_threads

from kvrelay.config import DisaggConfig, EngineConfig
from kvrelay.engine.tp_worker import check_supported
from kvrelay.weights.loader import resolve

MODEL = "qwen3-tiny"
SERVE = ("--model", MODEL, "--load-format", "dummy", "--device", "cpu", "--dtype", "float32")
STORY = "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps. "


@pytest.fixture(scope="module")
def pd():
    """The PD stack (prefill TP=1, decode TP=2), a TP=2 prefill and a TP=1 decode, all started
    side by side: (stack, {pair name: its router})."""
    TP2 = ("--tensor-parallel-size", "2")
    pd_common = (*SERVE, "--max-total-tokens", "4096", "--pd-secret", PD_SECRET)
    with engine_threads(), ThreadPoolExecutor(3) as ex:
        fs = ex.submit(PDStack, decode_args=TP2, max_total_tokens=4096, model=SERVE)
        fp2 = ex.submit(
            ServerProcess, *pd_common, "--role", "prefill", "--max-num-batched-tokens", "64", *TP2
        )
        fd1 = ex.submit(ServerProcess, *pd_common, "--role", "decode")
    futures, routers = (fs, fp2, fd1), []
    try:
        stack, p2, d1 = (f.result() for f in futures)
        with ThreadPoolExecutor(2) as ex:
            fr = [
                ex.submit(RouterProcess, [p2.url], [d.url], "--pd-secret", PD_SECRET)
                for d in (d1, stack.decode)
            ]
        routers = [f.result() for f in fr if f.exception() is None]
        assert len(routers) == 2, [f.exception() for f in fr]
        yield stack, {"p1-d2": stack.router, "p2-d1": routers[0], "p2-d2": routers[1]}
    finally:
        up = routers + [f.result() for f in futures if f.exception() is None]
        with ThreadPoolExecutor(len(up) or 1) as ex:  # side by side: each waits for its exit
            list(ex.map(lambda p: p.close(), up))


_want: list[dict] = []  # the reference's answers, asked once


@pytest.mark.parametrize("pair", ["p1-d2", "p2-d1", "p2-d2"])
def test_pd_with_tp_matches_single_server(pd, pair: str):
    """The reference is the TP=1 prefill server answering plain requests (no PD fields: it runs
    them whole, as a single server does): one server fewer to start."""
    stack, routers = pd
    prompts = ["Hello there", STORY * 4, STORY * 9 + "1, 2, 3,"]  # up to ~170 tokens
    specs = [
        {"kind": "completion", "prompt": p, "stream": i == 1, "max_tokens": 12, "logprobs": 2}
        for i, p in enumerate(prompts)
    ]
    if not _want:
        _want.extend(run_specs(stack.prefill.url, MODEL, specs))
    got = run_specs(routers[pair].url, MODEL, specs)
    assert_same_outputs(specs, _want, got, rel=1e-4, abs=1e-4)
    assert all(r["text"] for r in _want)
    if pair == "p1-d2":
        stack.wait_idle()
    assert routers[pair].metric("kvrelay_router_requests_total", '{outcome="error"}') == 0


@pytest.mark.parametrize(
    "role, backend, why",
    [
        ("prefill", "cuda_ipc", "prefill role needs --transfer-backend tcp"),
        ("decode", "cuda_ipc", "decode role needs --transfer-backend tcp"),
    ],
)
def test_unsupported_dense_tp_roles_are_refused(role: str, backend: str, why: str):
    """Rank 0's pages hold only its KV heads: cuda_ipc would copy whole rows out of them
    (prefill) or into them (decode)."""
    cfg = EngineConfig(
        model=MODEL,
        load_format="dummy",
        role=role,
        tensor_parallel_size=2,
        disagg=DisaggConfig(transfer_backend=backend),
    )
    with pytest.raises(ValueError, match=why):
        check_supported(cfg, resolve(MODEL, "dummy", None))
