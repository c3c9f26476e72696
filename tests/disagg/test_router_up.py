"""What `make serve` starts (`kvrelay up`: router, prefill and decode) answers lm-eval's batched
loglikelihood request and sglang bench_serving's session as one server does (issue 28 items
2-4): the recorded requests of tests/server/fixtures/, replayed through the stack."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import httpx
import pytest

TESTS = Path(__file__).parents[1]
sys.path[:0] = [str(TESTS / "ops"), str(TESTS / "server")]
from test_generate_logprobs import replay_bench  # noqa: E402
from test_launcher import _up  # noqa: E402

LM_EVAL = json.loads(
    (TESTS / "server" / "fixtures" / "lm_eval_loglikelihood_batch.json").read_text()
)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    stack = _up(
        tmp_path_factory.mktemp("up"),
        *("--model", "smollm2", "--max-total-tokens", "8192", "--health-timeout", "400"),
    )
    try:
        yield stack.wait_for(r"kvrelay up ready: (http://\S+) .*\| try: curl ", 450)[1]
    finally:
        stack.proc.send_signal(signal.SIGINT)
        try:
            stack.proc.wait(timeout=60)
        except Exception:
            stack.proc.kill()


def test_lm_eval_batch_and_sglang_bench_through_kvrelay_up(up, server):
    body = LM_EVAL["request"]
    want = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()
    r = httpx.post(up + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text  # was a 400: batched prompts, echo through the router
    got = r.json()
    assert [c["index"] for c in got["choices"]] == list(range(len(body["prompt"])))
    for w, g, ctxlen in zip(want["choices"], got["choices"], LM_EVAL["ctxlens"], strict=True):
        assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
        assert g["logprobs"]["token_logprobs"][0] is None
        assert g["logprobs"]["token_logprobs"][1:] == pytest.approx(
            w["logprobs"]["token_logprobs"][1:], abs=1e-3
        )
        assert sum(g["logprobs"]["token_logprobs"][ctxlen:-1]) == pytest.approx(
            sum(w["logprobs"]["token_logprobs"][ctxlen:-1]), abs=1e-3
        )
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    replay_bench(up)  # was a 400: return_logprob, return_routed_experts, lora_path
