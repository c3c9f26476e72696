"""install_error_handlers on a real FastAPI app: an unexpected exception is a 500 in the OpenAI
shape (never a plain-text body) and is counted, like 404, 405 and validation errors."""

from __future__ import annotations

from collections import Counter

from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvrelay.server.errors import install_error_handlers


def _app() -> tuple[FastAPI, Counter]:
    app = FastAPI()
    counts: Counter = Counter()
    install_error_handlers(app, lambda status: counts.update([status]))

    @app.get("/boom")
    async def boom():
        raise RuntimeError("kaboom")

    @app.get("/items")
    async def items(limit: int = 0):
        return {"limit": limit}

    return app, counts


def test_every_error_is_openai_shaped_and_counted():
    app, counts = _app()
    c = TestClient(app, raise_server_exceptions=False)
    for path, method, status, param in (
        ("/boom", "GET", 500, None),
        ("/nowhere", "GET", 404, None),
        ("/items", "POST", 405, None),
        ("/items?limit=lots", "GET", 400, "limit"),
    ):
        r = c.request(method, path)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
        assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert "kaboom" in c.get("/boom").json()["error"]["message"]
    assert counts == Counter({500: 2, 404: 1, 405: 1, 400: 1})
