"""Who may use a server, and how much they may send (a real `kvrelay serve` process).

One prefill-role server started with an API key, a small body limit and no PD secret: /health, /ready,
/ping and /metrics stay open, every other route needs `Authorization: Bearer KEY` (401 in the OpenAI error
format otherwise), bodies over the limit get 413 whether chunked or not, and PD routing fields are
refused (403) without a connection to the decode address they name.
"""

from __future__ import annotations

import socket
from dataclasses import asdict, replace

import httpx
import openai
import pytest
from conftest import ServerProcess

from kvrelay.config import ServerConfig, api_key_headers, env_snapshot, redacted
from kvrelay.ledger.record import fetch_server_info

KEY = "sk-access-test-0123456789"
LIMIT = 64 << 10
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded():
    s = ServerProcess(
        *("--model", "smollm2", "--max-total-tokens", "4096", "--role", "prefill"),
        *("--api-key", KEY, "--max-body-bytes", str(LIMIT)),
    )
    yield s
    s.close()


def _is_openai_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"], err


def test_health_ready_and_metrics_stay_open(guarded):
    assert httpx.get(guarded.url + "/health").status_code == 200  # alive
    assert httpx.get(guarded.url + "/metrics").status_code == 200
    for method in ("GET", "POST"):  # vLLM-style liveness probes carry no key
        assert httpx.request(method, guarded.url + "/ping").status_code == 200
    # ... but a prefill server without the PD secret serves nothing, and says so where asked
    r = httpx.get(guarded.url + "/ready")
    _is_openai_error(r, 503, "engine_unavailable")
    assert "without a PD secret" in r.json()["error"]["message"], r.text


ROUTES = [
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/server_info"),
    ("GET", "/version"),
    ("POST", "/tokenize"),
    ("GET", "/telemetry/steps"),
    ("GET", "/telemetry/profile"),
    ("POST", "/telemetry/profile"),
    ("GET", "/pd/info"),
    ("GET", "/health_generate"),
    ("GET", "/openapi.json"),
    ("GET", "/load"),
]


@pytest.mark.parametrize("method,path", ROUTES)
def test_every_other_route_needs_the_key(guarded, method, path):
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"}]
    for headers in wrong:
        r = httpx.request(method, guarded.url + path, headers=headers, json={"every": 0})
        _is_openai_error(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"


def test_the_openai_client_with_and_without_the_key(guarded):
    bad = openai.OpenAI(base_url=guarded.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list()] == ["smollm2"]


def test_load_answers_with_the_key(guarded):
    """The load report the PD router's probe reads (it sends the key): an idle server's."""
    load = httpx.get(guarded.url + "/load", headers=AUTH).json()
    assert load["running"] == load["waiting"] == load["requests"] == 0, load
    assert load["queued_prompt_tokens"] == 0 and 0 < load["free_pages"] <= load["total_pages"]


def test_server_info_never_shows_a_secret(guarded):
    r = httpx.get(guarded.url + "/server_info", headers=AUTH)
    assert r.status_code == 200 and KEY not in r.text
    cfg = r.json()["config"]
    assert cfg["api_key"] == "<set>" and cfg["engine"]["disagg"]["pd_secret"] == ""


def test_secrets_are_redacted_in_configs_and_env(monkeypatch):
    monkeypatch.setenv("KVRELAY_PD_SECRET", "hunter2")
    assert env_snapshot()["KVRELAY_PD_SECRET"] == "<set>"
    monkeypatch.setenv("KVRELAY_PD_SECRET", "")
    assert env_snapshot()["KVRELAY_PD_SECRET"] == ""
    cfg = replace(ServerConfig(), api_key="k")
    assert "'k'" not in repr(cfg) and redacted(asdict(cfg))["api_key"] == "<set>"


def test_kvrelay_clients_send_the_key_from_the_environment(guarded, monkeypatch):
    monkeypatch.setenv("KVRELAY_API_KEY", "")
    assert api_key_headers() == {}
    assert "error" in fetch_server_info(guarded.url)  # 401: the configuration stays unknown
    monkeypatch.setenv("KVRELAY_API_KEY", KEY)
    assert api_key_headers() == AUTH
    info = fetch_server_info(guarded.url)
    assert info["config"]["api_key"] == "<set>" and "error" not in info


def _chunks(n: int, model: str = "smollm2"):
    yield b'{"model": "%s", "prompt": "' % model.encode()
    for _ in range(n):
        yield b"x" * 8192
    yield b'", "max_tokens": 1}'


def test_bodies_over_the_limit_get_413_chunked_or_not(guarded):
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60) as c:
        # No Content-Length: refused once the limit is passed, not read whole first.
        r = c.post("/v1/completions", content=_chunks(4 * LIMIT // 8192))
        assert "content-length" not in r.request.headers
        _is_openai_error(r, 413, "request_too_large")
        r = c.post("/v1/completions", content=b"x" * (LIMIT + 1))
        _is_openai_error(r, 413, "request_too_large")
        # Under the limit, chunked: read whole and judged on its content.
        r = c.post("/v1/completions", content=_chunks(2, model="nope"))
        _is_openai_error(r, 404, "model_not_found")
        assert c.get("/health").status_code == 200


def test_pd_fields_without_a_pd_secret_are_refused_without_connecting(guarded):
    with socket.create_server(("127.0.0.1", 0)) as decode:
        decode.settimeout(1.5)
        pd = {
            "role": "prefill",
            "transfer_id": "t-forged",
            "request_id": "cmpl-forged",
            "decode_addr": f"127.0.0.1:{decode.getsockname()[1]}",
        }
        body = {"model": "smollm2", "prompt": "hi", "max_tokens": 2, "kvrelay_pd": pd}
        r = httpx.post(guarded.url + "/v1/completions", json=body, headers=AUTH)
        _is_openai_error(r, 403, "pd_secret_missing")
        with pytest.raises(TimeoutError):
            decode.accept()  # nobody came
    warnings = [ln for ln in guarded.log().splitlines() if "no PD secret" in ln]
    assert len(warnings) == 1 and "WARNING" in warnings[0], warnings
