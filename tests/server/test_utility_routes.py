"""vLLM's utility routes on one server (issue 28 item 6): /tokenize (prompt or messages, vLLM's
request and response shapes), /detokenize, /version, /ping (GET and POST), HEAD /health, and
/v1/models' `created` (the server's start time, not 0)."""

from __future__ import annotations

import time

import httpx
import pytest

from kvrelay.server.utility_routes import kvrelay_version

MODEL = "smollm2"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_tokenize_a_prompt_and_back(server, smollm2_tokenizer):
    r = _post(
        server, "/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True}
    )
    d = r.json()
    ids = smollm2_tokenizer.encode("Hello world", add_special_tokens=True)
    assert d == {"count": len(ids), "max_model_len": 8192, "tokens": ids,
                 "token_strs": smollm2_tokenizer.convert_ids_to_tokens(ids)}  # fmt: skip
    assert _post(server, "/tokenize", {"prompt": "Hello"}).json()["token_strs"] is None
    assert _post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": "Hello world"}


def test_tokenize_messages_is_the_chat_prompt(server):
    """The same tokens /v1/chat/completions reads (its usage.prompt_tokens), with and without
    the generation prompt."""
    d = _post(server, "/tokenize", {"messages": MSGS}).json()
    chat = _post(
        server, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 1}
    ).json()
    assert d["count"] == len(d["tokens"]) == chat["usage"]["prompt_tokens"]
    bare = _post(server, "/tokenize", {"messages": MSGS, "add_generation_prompt": False}).json()
    assert bare["count"] < d["count"] and d["tokens"][: bare["count"]] == bare["tokens"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": MSGS}, 400, None),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": "a", "add_special_tokens": 1}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
        ("/tokenize", {"prompt": "a", "truncate": 3}, 400, "truncate"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens[0]"),
    ],
)
def test_bad_utility_requests_name_the_field(server, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_version_ping_head_health_and_models_created(server):
    assert httpx.get(server.url + "/version").json() == {"version": kvrelay_version()}
    assert kvrelay_version() not in ("", "unknown")
    for method in ("GET", "POST"):
        assert httpx.request(method, server.url + "/ping").status_code == 200
    h = httpx.head(server.url + "/health")
    assert h.status_code == 200 and h.content == b""
    created = httpx.get(server.url + "/v1/models").json()["data"][0]["created"]
    assert time.time() - 24 * 3600 < created <= time.time()  # was 0
    assert httpx.get(server.url + f"/v1/models/{MODEL}").json()["created"] == created
