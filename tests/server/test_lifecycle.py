"""Health endpoints, client disconnects, and a dead engine process (never a silent hang)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from conftest import ServerProcess


def _wait_idle(server, timeout: float = 15.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (
            server.metric("kvrelay_kv_pages_used") == 0
            and server.metric("kvrelay_num_requests_running") == 0
        ):
            return
        time.sleep(0.2)
    raise AssertionError("KV pages or running requests were not freed")


def test_health_and_health_generate(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    assert "kvrelay_num_requests_running" in httpx.get(server.url + "/metrics").text


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc/PID/maps")
def test_the_api_process_never_loads_torch(smollm2_tokenizer):
    """Tensors live in the engine process; torch in the API process cost every start ~1.4 s of
    CPU and ~200 MB. Its tokenizer (converted already: the fixture wrote the session's entry;
    converting a GGUF's needs transformers' model code, torch included), chat template and
    routes run without it."""
    s = ServerProcess("--model", "smollm2", "--max-total-tokens", "256")
    try:
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
        }
        assert httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        with open(f"/proc/{s.proc.pid}/maps") as f:
            assert "libtorch" not in f.read()
    finally:
        s.close()


def test_client_disconnect_mid_stream_frees_everything(server):
    body = {
        "model": "smollm2",
        "prompt": "Count: 1, 2, 3,",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", server.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data:") for x in got)
        assert server.metric("kvrelay_kv_pages_used") > 0
    # The connection is closed mid-generation: the request must be aborted and its KV freed.
    _wait_idle(server)


def test_client_disconnect_non_streaming_frees_everything(server):
    body = {"model": "smollm2", "prompt": "Count: 1, 2, 3,", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=2.0)
    _wait_idle(server)
    # An abort is expected, not an unhandled error: no asyncio traceback in the server's log.
    assert "exception was never retrieved" not in server.log()


def test_dead_engine_gives_503_and_failed_health(monkeypatch):
    # KVRELAY_ENGINE_DEATH_EXIT_S=0: the server stays up answering 503 (by default it exits 3
    # two seconds after the death: tests/ops/test_engine_death.py).
    monkeypatch.setenv("KVRELAY_ENGINE_DEATH_EXIT_S", "0")
    s = ServerProcess("--model", "smollm2", "--max-total-tokens", "8192")
    try:
        result = {}

        def long_request():
            body = {"model": "smollm2", "prompt": "Once", "max_tokens": 4000, "ignore_eos": True}
            t0 = time.time()
            result["r"] = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            result["t"] = time.time() - t0

        th = threading.Thread(target=long_request)
        th.start()
        # Killed mid-request: once the engine reports it running (it decodes for minutes).
        deadline = time.time() + 60
        while s.metric("kvrelay_num_requests_running") < 1:
            assert time.time() < deadline and th.is_alive(), "the request never ran"
            time.sleep(0.05)
        os.kill(s.engine_pid(), signal.SIGKILL)
        th.join(timeout=30)
        assert not th.is_alive(), "in-flight request hung after the engine died"
        assert result["r"].status_code == 503 and "engine" in result["r"].json()["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 503
        r = httpx.post(
            s.url + "/v1/chat/completions",
            timeout=10,
            json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 503
        assert s.proc.poll() is None  # the API process itself stays up to answer
    finally:
        s.close()
