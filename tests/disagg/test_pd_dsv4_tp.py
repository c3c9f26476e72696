"""DeepSeek-V4 PD with tensor parallel on either side == one single TP=1 server: prefill TP=2
with expert parallel (two gloo ranks; rank 0 sends the cache, which every rank holds whole) to
decode TP=1, prefill TP=1 to decode TP=2 (decode's rank 0 receives and hands each piece to rank
1: engine/tp_install.py), and prefill TP=2 + EP to decode TP=2. One decode TP=2 server (with
expert parallel and all-to-all token dispatch: the served path of `--ep-dispatch all-to-all`)
and two prefill servers serve the three pairs, each through a router of its own.

The trained dsv4-tiny-agent (real weights, peaked logits, no QAT simulation) in float32 on the
CPU; prefill runs 22-token chunks, so chunks end mid-window. Greedy text must be identical;
logprobs agree within 1e-4 (TP sums float32 partial sums in another order than one rank).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import ServerProcess
from openai_calls import assert_same_outputs, run_specs
from pd_stack import PD_SECRET, PDStack, RouterProcess, engine_threads

AGENT = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "dsv4-tiny-agent"
pytestmark = pytest.mark.skipif(not (AGENT / "config.json").is_file(), reason=f"no {AGENT}")
MODEL = "dsv4-tiny-agent"
SERVE = ("--model", str(AGENT), "--served-model-name", MODEL, "--device", "cpu")
SERVE += ("--dtype", "float32")
PREFILL = ("--max-num-batched-tokens", "22", "--tensor-parallel-size", "2", "--expert-parallel")
DECODE_TP2 = ("--tensor-parallel-size", "2", "--expert-parallel", "--ep-dispatch", "all-to-all")
STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
    "listening to the sea, and writing the weather into a leather notebook. "
)


@pytest.fixture(scope="module")
def stacks():
    """The single server, the PD stack (prefill TP=2 + EP, decode TP=1), and routers from its
    prefill and from a TP=1 prefill to a TP=2 + EP (all-to-all) decode: {pair name: its router}."""
    pd_common = (*SERVE, "--max-total-tokens", "4096", "--pd-secret", PD_SECRET)
    with engine_threads(), ThreadPoolExecutor(4) as ex:
        fs = ex.submit(ServerProcess, *SERVE, "--max-total-tokens", "4096")
        fp = ex.submit(PDStack, prefill_args=PREFILL, max_total_tokens=4096, model=SERVE)
        fd2 = ex.submit(ServerProcess, *pd_common, "--role", "decode", *DECODE_TP2)
        fp1 = ex.submit(
            ServerProcess, *pd_common, "--role", "prefill", "--max-num-batched-tokens", "22"
        )
    futures, routers = (fs, fp, fd2, fp1), []
    try:
        single, pd, d2, p1 = (f.result() for f in futures)
        for p in (p1, pd.prefill):
            routers.append(RouterProcess([p.url], [d2.url], "--pd-secret", PD_SECRET))
        yield single, pd, {"p2ep-d1": pd.router, "p1-d2": routers[0], "p2ep-d2": routers[1]}
    finally:
        for r in routers:
            r.close()
        for f in futures:
            if f.exception() is None:
                f.result().close()


def _specs() -> list[dict]:
    prompts = ["Count from 4 to 9.", STORY * 2, STORY * 4 + "1, 2, 3,"]  # up to ~125 tokens
    specs = [
        {
            "kind": "completion",
            "prompt": p,
            "stream": i % 2 == 1,
            "max_tokens": 12,
            "logprobs": 2 if i == 0 else None,
        }
        for i, p in enumerate(prompts)
    ]
    chats = [("What is the weather in Lima?", True), ("Add 7 and 90.", False)]
    specs += [
        {"kind": "chat", "content": c, "stream": s, "max_tokens": 16, "logprobs": not s}
        for c, s in chats
    ]
    return specs


_want: list[dict] = []  # the single server's answers, asked once


@pytest.mark.parametrize("pair", ["p2ep-d1", "p1-d2", "p2ep-d2"])
def test_pd_with_tp_matches_single_server(stacks, pair: str):
    single, pd, routers = stacks
    specs = _specs()
    if not _want:
        _want.extend(run_specs(single.url, MODEL, specs))
    got = run_specs(routers[pair].url, MODEL, specs)
    assert_same_outputs(specs, _want, got, rel=1e-4, abs=1e-4)
    assert all(r["text"] for r in _want)
    if pair == "p2ep-d1":
        pd.wait_idle()
    assert routers[pair].metric("kvrelay_router_requests_total", '{outcome="error"}') == 0
