"""Injected transfer faults through real processes (test-only prefill flags): the client gets an
error naming the cause within a bounded time, the failure is counted, no damaged output is ever
answered with 200, and both servers stay healthy with nothing leaked.

One stack: first prefill corrupts transfers with probability 0.5, then prefill alone is restarted
to delay every transfer past its (short) timeout. The router makes one attempt per request, so
each client sees its own attempt's outcome.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai_calls import client
from pd_stack import PDStack, metrics

MODEL = "smollm2"
PROMPTS = [
    "The capital of France is",
    "Write a list of fruits: apple, banana,",
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps. " * 3,
]


@pytest.fixture(scope="module")
def stack():
    s = PDStack(
        prefill_args=("--test-corrupt-transfer", "0.5"),
        router_args=("--max-attempts", "1"),
        max_total_tokens=8192,
    )
    yield s
    s.close()


def _request(url: str, i: int) -> dict:
    """Greedy completion of PROMPTS[i % 3] (odd i: streamed); the outcome, never raising."""
    c = client(url, timeout=120)
    kw = dict(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=8, temperature=0)
    t = time.time()
    try:
        if i % 2:
            text = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw))
        else:
            text = c.completions.create(**kw).choices[0].text
        return {"i": i, "ok": True, "text": text, "s": time.time() - t}
    except openai.APIError as e:
        status = getattr(e, "status_code", None)
        return {"i": i, "ok": False, "status": status, "code": e.code, "s": time.time() - t}


def _failures(url: str, name: str, cause: str) -> float:
    return metrics(url).get(f'{name}{{cause="{cause}"}}', 0.0)


def _healthy(stack: PDStack) -> None:
    for srv in (stack.prefill, stack.decode):
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200


def test_corrupt_bytes_fail_the_request_with_an_integrity_error(stack):
    n = 18
    with ThreadPoolExecutor(6) as ex:
        outs = list(ex.map(lambda i: _request(stack.router.url, i), range(n)))
    failed = [o for o in outs if not o["ok"]]
    ok = [o for o in outs if o["ok"]]
    print(f"corrupt p=0.5: {len(failed)} of {n} failed, slowest {max(o['s'] for o in outs):.1f}s")
    assert failed and ok, "p=0.5 over 18 requests should give both outcomes"
    for o in failed:  # an HTTP error, or the first SSE event is the error: both 502 here
        assert (o["status"], o["code"]) == (502, "checksum_mismatch"), o
    # Every 200 for the same prompt has the same text: a damaged KV page (16 bytes flipped,
    # exponents included) that slipped through would change greedy output.
    for p in range(len(PROMPTS)):
        texts = {o["text"] for o in ok if o["i"] % len(PROMPTS) == p}
        assert len(texts) <= 1, f"prompt {p}: different 200 answers {texts}"
    stack.wait_idle()
    _healthy(stack)
    name = "kvrelay_pd_transfer_failures_total"
    assert _failures(stack.decode.url, name, "checksum_mismatch") == len(failed)
    assert _failures(stack.router.url, "kvrelay_router_failures_total", "checksum_mismatch") == len(
        failed
    )
    # Prefill learns it from decode; its own count may miss a request the router cancelled first.
    assert 1 <= _failures(stack.prefill.url, name, "checksum_mismatch") <= len(failed)


def test_transfer_delayed_past_the_timeout_is_a_timeout_error(stack):
    """Prefill (restarted alone) holds every KV piece 8 s; it gives up on decode's
    acknowledgement after 3 s and tells decode, which answers the client 504."""
    stack.restart(
        "prefill",
        "--test-corrupt-transfer",
        "0",
        "--test-delay-transfer",
        "8",
        "--transfer-bootstrap-timeout",
        "3",
        "--transfer-timeout",
        "3",
    )
    decode_before = metrics(stack.decode.url)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda i: _request(stack.router.url, i), range(4)))
    print(f"delayed transfer: errors after {sorted(round(o['s'], 1) for o in outs)} s")
    for o in outs:
        assert not o["ok"] and (o["status"], o["code"]) == (504, "transfer_timeout"), o
        assert o["s"] < 15, f"timeout error after {o['s']:.1f}s: a hang, not a 3 s timeout"
    stack.wait_idle()
    _healthy(stack)
    name = "kvrelay_pd_transfer_failures_total"
    assert _failures(stack.prefill.url, name, "transfer_timeout") == len(outs)  # it timed out
    # Decode learns it from prefill, unless the router (answering with prefill's error) cancels
    # decode's copy first.
    got = {
        cause: _failures(stack.decode.url, name, cause)
        - decode_before.get(f'{name}{{cause="{cause}"}}', 0)
        for cause in ("transfer_timeout", "aborted")
    }
    assert got["transfer_timeout"] >= 1 and sum(got.values()) == len(outs), got
    assert _failures(stack.router.url, "kvrelay_router_failures_total", "transfer_timeout") == len(
        outs
    )
