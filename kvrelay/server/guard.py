"""The HTTP front door of the server and the router: the API key, and bounded request bodies.

An ASGI middleware, so that it holds for every route and before any route reads a byte:
- with an API key set, every path but /health, /ready, /ping and /metrics needs `Authorization: Bearer KEY`
  (compared in constant time); anything else gets 401, before the body is read;
- a body larger than the limit gets 413, whether it announces its length (Content-Length) or not
  (chunked): the body is read incrementally, and the answer goes out as soon as the limit is
  passed (the server reads the rest of the body and drops it, so the client gets its 413
  rather than a reset connection).
- a request with both Content-Length and Transfer-Encoding gets 400 at once, its body unread,
  and the connection is closed.
All answers are OpenAI-format errors. (Read deadlines for headers and bodies: http_timeouts.py.)
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from kvrelay.server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/ready", "/ping", "/metrics"})  # probes: nothing to hide


class HttpGuard:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str = "",
        max_body_bytes: int = 4 << 20,
        on_reject: Callable[[int], None] | None = None,
        open_paths: frozenset[str] = OPEN_PATHS,
    ) -> None:
        self.app = app
        self.key = api_key.encode()
        self.limit = max_body_bytes
        self.on_reject = on_reject
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _ambiguous_length(scope):
            err = APIError(
                400,
                "a request may not carry both Content-Length and Transfer-Encoding",
                code="ambiguous_body_length",
            )
            await self._answer(err, scope, receive, send, {"connection": "close"}, read=False)
            return
        if self.key and scope["path"] not in self.open_paths and not self._key_ok(scope):
            err = APIError(
                401,
                "a valid API key is required: send `Authorization: Bearer KEY`",
                param=None,
                code="invalid_api_key",
            )
            await self._answer(err, scope, receive, send, {"www-authenticate": "Bearer"})
            return
        body, too_large = await self._read_body(scope, receive)
        if too_large:
            err = APIError(
                413, f"request body larger than {self.limit} bytes", code="request_too_large"
            )
            await self._answer(err, scope, receive, send, {})
            return
        if body is None:  # the client left while sending
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    def _key_ok(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, key = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.key)
        return False

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes | None, bool]:
        """(the body, False); (None, True) as soon as it passes the limit; (None, False) when
        the client disconnected first."""
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                return None, True
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None, False
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return None, True
            if chunk:
                chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks), False

    async def _answer(
        self,
        err: APIError,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: dict[str, str],
        read: bool = True,
    ) -> None:
        """`read`: False when the body must not be read at all (its length is unknowable); the
        response closes the connection then."""
        if self.on_reject is not None:
            self.on_reject(err.status)
        response = err.response()
        response.headers.update(headers)

        async def nothing() -> dict:  # never the body: only a disconnect, never before it
            return {"type": "http.disconnect"}

        await response(scope, receive if read else nothing, send)


def _ambiguous_length(scope: Scope) -> bool:
    """Both Content-Length and Transfer-Encoding (RFC 9112 6.3: a request smuggling vector; a
    proxy and this server could split the stream differently): refused at once, not read."""
    names = {name for name, _ in scope["headers"]}
    return b"content-length" in names and b"transfer-encoding" in names
