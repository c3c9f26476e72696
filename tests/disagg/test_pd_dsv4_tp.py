"""DeepSeek-V4 PD with a tensor-parallel prefill side: prefill TP=2 with expert parallel (two
gloo ranks; rank 0 sends the cache, which every rank holds whole) and decode TP=1 == one single
TP=1 server.

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
from pd_stack import PD_SECRET, PDStack, engine_threads

AGENT = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "dsv4-tiny-agent"
pytestmark = pytest.mark.skipif(not (AGENT / "config.json").is_file(), reason=f"no {AGENT}")
MODEL = "dsv4-tiny-agent"
SERVE = ("--model", str(AGENT), "--served-model-name", MODEL, "--device", "cpu")
SERVE += ("--dtype", "float32")
PREFILL = ("--max-num-batched-tokens", "22", "--tensor-parallel-size", "2", "--expert-parallel")
STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
    "listening to the sea, and writing the weather into a leather notebook. "
)


@pytest.fixture(scope="module")
def stacks():
    with engine_threads(), ThreadPoolExecutor(2) as ex:
        fs = ex.submit(ServerProcess, *SERVE, "--max-total-tokens", "4096")
        fp = ex.submit(
            PDStack,
            prefill_args=PREFILL,
            max_total_tokens=4096,
            model=SERVE,
        )
    try:
        yield fs.result(), fp.result()
    finally:
        for f in (fs, fp):
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


def test_pd_with_tp2_prefill_matches_single_server(stacks):
    single, pd = stacks
    specs = _specs()
    want = run_specs(single.url, MODEL, specs)
    got = run_specs(pd.router.url, MODEL, specs)
    assert_same_outputs(specs, want, got, rel=1e-4, abs=1e-4)
    assert all(r["text"] for r in want)
    pd.wait_idle()
    assert pd.router.metric("kvrelay_router_requests_total", '{outcome="error"}') == 0


def test_decode_role_refuses_tp():
    """A TP decode side would have to install received rows on every rank: refused at startup."""
    with pytest.raises(Exception, match="single and prefill roles only"):
        ServerProcess(
            *SERVE, "--role", "decode", "--tensor-parallel-size", "2", "--pd-secret", PD_SECRET
        )
