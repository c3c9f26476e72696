"""Who may use the router, and how much they may send: a real router on a real port (uvicorn, in
this process) in front of servers that are not there. The API key and the body limit are checked
before any routing; a router without the PD secret says so instead of routing."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import uvicorn
from conftest import free_port

from kvrelay.config import RouterConfig
from kvrelay.router.app import create_router_app

KEY = "sk-router-test"
LIMIT = 64 << 10
AUTH = {"Authorization": f"Bearer {KEY}"}
NOWHERE = ("http://127.0.0.1:9",)  # discard port: nothing listens


class RunningRouter:
    def __init__(self, cfg: RouterConfig) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        app = create_router_app(cfg)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "router did not start"
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _router(**kw) -> RunningRouter:
    cfg = dict(prefill=NOWHERE, decode=NOWHERE, connect_timeout_s=1.0, pd_secret="s")
    return RunningRouter(RouterConfig(**(cfg | kw)))


@pytest.fixture(scope="module")
def router():
    r = _router(api_key=KEY, max_body_bytes=LIMIT)
    yield r
    r.close()


def _error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text


def test_health_ready_and_metrics_stay_open(router):
    assert httpx.get(router.url + "/health").status_code == 200  # alive, with no server behind
    _error(httpx.get(router.url + "/ready"), 503, "not_ready")  # open too, and not ready
    assert httpx.get(router.url + "/metrics").status_code == 200


@pytest.mark.parametrize(
    "method,path",
    [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")],
)
def test_the_key_is_needed_everywhere_else(router, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        _error(httpx.request(method, router.url + path, headers=headers), 401, "invalid_api_key")
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        c.completions.create(model="m", prompt="hi", max_tokens=1)


def test_with_the_key_a_request_is_routed(router):
    """Past the guard: the router tries the (absent) servers and names why it cannot."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    r = httpx.post(router.url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    _error(r, 503, "prefill_unreachable")


def test_bodies_over_the_limit_get_413_chunked_or_not(router):
    def chunks():
        yield b'{"model": "m", "prompt": "'
        for _ in range(4 * LIMIT // 8192):
            yield b"x" * 8192
        yield b'"}'

    with httpx.Client(base_url=router.url, headers=AUTH, timeout=30) as c:
        r = c.post("/v1/completions", content=chunks())
        assert "content-length" not in r.request.headers
        _error(r, 413, "request_too_large")
        _error(c.post("/v1/chat/completions", content=b"x" * (LIMIT + 1)), 413, "request_too_large")
        _error(c.post("/v1/completions", content=b"[1]"), 400, None)  # still serving


def test_a_router_without_a_pd_secret_refuses_to_route():
    r = _router(pd_secret="")
    try:
        body = {"model": "m", "prompt": "hi", "max_tokens": 1}
        _error(httpx.post(r.url + "/v1/completions", json=body), 503, "pd_secret_missing")
        ready = httpx.get(r.url + "/ready")
        _error(ready, 503, "not_ready")
        assert "no PD secret" in ready.json()["error"]["message"], ready.text
    finally:
        r.close()


HOSTILE = [
    (b'{"model": "m", "prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"model": "m", "prompt": "hi", "seed": 1180591620717411303424}', "seed"),
    (b'{"model": "m", "prompt": "hi", "top_k": 1180591620717411303424}', "top_k"),
    (b'{"model": "m", "prompt": "hi", "stop_token_ids": [1180591620717411303424]}', "stop_token_ids[0]"),
    (b'{"model": "m", "prompt": "\\ud800"}', "prompt"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
     b'"tools": [{"type": "function", "function": {"name": "f"}}], '
     b'"tool_choice": {"type": "function", "function": "f"}}', "tool_choice.function"),
    (b'{"model": "m", "prompt": "hi", "max_tokens": 0}', "max_tokens"),
    # Prompt logprobs: prefill would compute them and decode answer; refused, not dropped.
    # What one server refuses too (echo, prompt_logprobs and n > 1 are routed: issue 28).
    (b'{"model": "m", "prompt": "hi", "max_tokens": 0}', "max_tokens"),  # 0 only with echo
    (b'{"model": "m", "prompt": "hi", "prompt_logprobs": 1, "stream": true}', "prompt_logprobs"),
    (b'{"model": "m", "prompt": ["hi", ""]}', "prompt[1]"),
    (b'{"text": ["hi", ""]}', "text[1]"),
    # A boolean is not an integer; vLLM's extras are checked as the servers check them.
    (b'{"model": "m", "prompt": "hi", "max_tokens": true}', "max_tokens"),
    (b'{"model": "m", "prompt": "hi", "top_k": true}', "top_k"),
    (b'{"input_ids": [true, false]}', "input_ids[0]"),
    (b'{"model": "m", "prompt": "hi", "max_tokens": 2, "min_tokens": 3}', "min_tokens"),
    (b'{"model": "m", "prompt": "hi", "response_format": {"type": "json_object"}, '
     b'"guided_json": {}}', "guided_json"),
    (b'{"model": "m", "prompt": "hi", "structured_outputs": {"choice": ["a"], "regex": "a"}}',
     "structured_outputs.regex"),
    (b'{"model": "m", "prompt": "hi", "guided_whitespace_pattern": " "}',
     "guided_whitespace_pattern"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
     b'"continue_final_message": true}', "continue_final_message"),
]  # fmt: skip


@pytest.mark.parametrize("body,param", HOSTILE, ids=[p for _, p in HOSTILE])
def test_hostile_bodies_are_400s_before_any_routing(router, body, param):
    """The servers behind are absent: a 400 naming the field shows nothing was routed."""
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    path = "/generate" if b"input_ids" in body or body.startswith(b'{"text"') else path
    before = router_metric(router, "http_400")
    for stream in (False, True):
        data = body.replace(b"{", b'{"stream": true, ', 1) if stream else body
        r = httpx.post(router.url + path, content=data, headers=AUTH, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    assert router_metric(router, "http_400") == before + 2


def router_metric(router, outcome: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    want = f'kvrelay_router_requests_total{{outcome="{outcome}"}} '
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(want)), 0.0)


def test_unknown_routes_and_methods_are_openai_errors(router):
    for method, path, status, code in (
        ("GET", "/nope", 404, "not_found"),
        ("GET", "/v1/completions", 405, "method_not_allowed"),
    ):
        r = httpx.request(method, router.url + path, headers=AUTH, timeout=10)
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    doc = httpx.get(router.url + "/openapi.json", headers=AUTH, timeout=10).json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
