"""Every kind of bad input gets an OpenAI-style 4xx error, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]


def _chat(**kw) -> dict:
    return {"model": "smollm2", "messages": MSG, "max_tokens": 4, **kw}


CASES = [
    ("malformed json", CHAT, b'{"model": "smollm2", "messages": [', 400),
    ("not an object", CHAT, b"[1, 2, 3]", 400),
    ("missing messages", CHAT, {"model": "smollm2"}, 400),
    ("empty messages", CHAT, {"model": "smollm2", "messages": []}, 400),
    ("bad role", CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), 400),
    ("missing model", CHAT, {"messages": MSG}, 400),
    ("unknown model", CHAT, _chat(model="gpt-99"), 404),
    ("max_tokens zero", CHAT, _chat(max_tokens=0), 400),
    ("max_tokens negative", COMP, {"model": "smollm2", "prompt": "x", "max_tokens": -5}, 400),
    ("max_completion_tokens zero", CHAT, _chat(max_completion_tokens=0), 400),
    ("top_p zero", CHAT, _chat(top_p=0), 400),
    ("top_p above one", CHAT, _chat(top_p=1.5), 400),
    ("temperature negative", CHAT, _chat(temperature=-1), 400),
    ("n too large", CHAT, _chat(n=17), 400),
    ("wrong type", CHAT, _chat(max_tokens="lots"), 400),
    ("top_logprobs without logprobs", CHAT, _chat(top_logprobs=3), 400),
    ("empty prompt", COMP, {"model": "smollm2", "prompt": "", "max_tokens": 4}, 400),
    (
        "token id outside vocab",
        COMP,
        {"model": "smollm2", "prompt": [1, 2, 10**9], "max_tokens": 4},
        400,
    ),
    (
        "prompt longer than context",
        COMP,
        {"model": "smollm2", "prompt": "word " * 9000, "max_tokens": 4},
        400,
    ),
    (
        "max_tokens beyond context",
        COMP,
        {"model": "smollm2", "prompt": "Hi", "max_tokens": 10**6},
        400,
    ),
    ("oversized body", CHAT, _chat(messages=[{"role": "user", "content": "x" * (5 << 20)}]), 413),
    # Chunked (no Content-Length): read incrementally and refused at the limit, not read whole.
    (
        "oversized chunked body",
        CHAT,
        iter([b'{"model": "smollm2", "x": "'] + [b"x" * 65536] * 80),
        413,
    ),
]


@pytest.mark.parametrize("name,path,body,status", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_4xx_then_good_request_works(server, name, path, body, status):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        if not isinstance(body, dict):  # bytes, or an iterator: sent chunked
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = c.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and err["type"]
        ok = c.post(CHAT, json=_chat(temperature=0))
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
        assert c.get("/health").status_code == 200
