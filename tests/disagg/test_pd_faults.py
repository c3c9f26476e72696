"""Injected transfer faults through real processes: the client gets an error naming the cause,
the failure is counted, and both servers stay healthy with nothing leaked."""

from __future__ import annotations

import httpx
import openai
import pytest
from pd_stack import PDStack

MODEL = "smollm2"


@pytest.fixture(scope="module")
def corrupting():
    stack = PDStack(prefill_args=("--test-corrupt-transfer",))
    yield stack
    stack.close()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("stream", [False, True])
def test_corrupt_bytes_fail_the_request_with_an_integrity_error(corrupting, stream):
    c = _client(corrupting.router.url)
    with pytest.raises(openai.APIStatusError) as e:
        r = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello there!"}],
            max_tokens=8,
            temperature=0,
            stream=stream,
        )
        for _ in r:
            pass
    assert e.value.status_code == 502
    assert "checksum_mismatch" in str(e.value)
    corrupting.wait_idle()
    for srv in (corrupting.prefill, corrupting.decode):
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    assert corrupting.decode.metric("kvrelay_pd_transfer_failures_total") >= 1
    text = httpx.get(corrupting.router.url + "/metrics", timeout=5).text
    assert 'kvrelay_router_failures_total{cause="checksum_mismatch"}' in text
