"""DeepSeek-V4 (dsv4-tiny, dummy weights) over PD == one server, token for token.

Real processes: router + prefill + decode vs a single `kvrelay serve` of the same model. Prefill
runs 22-token chunks (not a multiple of either compress ratio, 4 and 16), so chunks end
mid-window and the prompts over 100 tokens carry compressed entries of both ratios, a full
sliding window and open compressor windows in the state slot. Greedy tokens must be identical
and logprobs match; afterwards pages, requests and transfers are back to idle on both sides.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ServerProcess
from openai_calls import assert_same_outputs, run_specs
from pd_stack import PDStack, engine_threads

MODEL = "dsv4-tiny"
SERVE = ("--model", MODEL, "--load-format", "dummy")
STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
    "listening to the sea, and writing the weather into a leather notebook. "
)


@pytest.fixture(scope="module")
def stacks():
    with engine_threads(), ThreadPoolExecutor(2) as ex:  # all four start in parallel
        fs = ex.submit(
            ServerProcess, *SERVE, "--max-total-tokens", "4096", "--max-num-batched-tokens", "64"
        )
        fp = ex.submit(
            PDStack,
            prefill_args=("--max-num-batched-tokens", "22"),
            max_total_tokens=4096,
            model=SERVE,
        )
    single = pd = None
    try:
        single, pd = fs.result(), fp.result()
        yield single, pd
    finally:
        for f in (fs, fp):
            if f.exception() is None:
                f.result().close()


def _specs() -> list[dict]:
    prompts = [
        "The capital of France is",
        STORY,  # 30 tokens: two chunks
        STORY * 6,  # 175 tokens
        STORY * 4,  # 117 tokens: 7 ratio-16 and 29 ratio-4 entries, a full window
        STORY * 2 + "1, 2, 3,",
        STORY * 5,  # 146 tokens
    ]
    specs = [
        {
            "kind": "completion",
            "prompt": p,
            "stream": i % 2 == 1,
            "max_tokens": 8 + 2 * i,
            "logprobs": 2 if i % 3 == 0 else None,
        }
        for i, p in enumerate(prompts)
    ]
    chats = [("Name three colours.", True), (STORY * 4 + "What did the keeper write?", False)]
    for i, (content, stream) in enumerate(chats):
        specs.append(
            {
                "kind": "chat",
                "content": content,
                "stream": stream,
                "max_tokens": 10,
                "logprobs": i == 1,
            }
        )
    return specs


def test_pd_matches_single_server_token_for_token(stacks):
    single, pd = stacks
    specs = _specs()
    want = run_specs(single.url, MODEL, specs)
    got = run_specs(pd.router.url, MODEL, specs)
    # Logprobs within 1e-4 relative: served dsv4-tiny simulates QAT (FP8 activations), which
    # turns last-bit GEMM differences between differently composed batches into ~1e-5 relative
    # ones; a cache error changes tokens (test_dsv4_transfer_agents.py checks 1e-4 absolute
    # with QAT off).
    assert_same_outputs(specs, want, got, rel=1e-4, abs=1e-4)
    pd.wait_idle()
    assert pd.router.metric("kvrelay_router_requests_total", '{outcome="error"}') == 0
    assert pd.router.metric("kvrelay_router_requests_total", '{outcome="ok"}') == len(specs)


def test_prefix_cache_hits_on_both_sides_still_match_single_server(stacks):
    """The same requests again: prefill now resumes from its cached pages (compressed entries,
    index keys, window rows and the compressor state kept at the page end); decode cached the
    pages it received (and those it computed), so it receives only what follows its own hit;
    decode continues token for token like the single server."""
    single, pd = stacks
    specs = _specs()
    want = run_specs(single.url, MODEL, specs)
    hits = pd.prefill.metric("kvrelay_prefix_cache_hit_tokens_total")
    decode_hits = pd.decode.metric("kvrelay_prefix_cache_hit_tokens_total")
    got = run_specs(pd.router.url, MODEL, specs)
    assert pd.prefill.metric("kvrelay_prefix_cache_hit_tokens_total") - hits >= 100
    assert pd.decode.metric("kvrelay_prefix_cache_hit_tokens_total") - decode_hits >= 100
    assert_same_outputs(specs, want, got, rel=1e-4, abs=1e-4)
    pd.wait_idle()
    with open(pd.decode.log_path) as f:
        assert "prefix_cache=on" in f.read()
