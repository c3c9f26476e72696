"""OpenAI-format error responses; the only place exceptions become HTTP statuses.

`install_error_handlers` makes every answer of an app an OpenAI error, whatever raised it: an
APIError, FastAPI's own 404 / 405 / validation errors, or an unexpected exception (500), and
reports each status to a counter."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvrelay.errors")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def sse(self) -> str:
        """The error as a server-sent event (a stream that has begun cannot change its status)."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str) -> APIError:
    return APIError(503, message, type_="service_unavailable", code="engine_unavailable")


def internal(e: BaseException) -> APIError:
    return APIError(
        500, f"internal error: {type(e).__name__}: {e}", "server_error", code="internal"
    )


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def install_error_handlers(app: FastAPI, count: Callable[[int], None]) -> None:
    """Every error `app` answers is an OpenAI error, counted by status with `count`."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        count(e.status)
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        count(e.status_code)
        if e.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        elif e.status_code == 405:
            msg = f"{request.method} is not allowed on {request.url.path}"
        else:
            msg = str(e.detail)
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        err = APIError(e.status_code, msg, kind, code=_HTTP_CODES.get(e.status_code))
        response = err.response()
        response.headers.update(e.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        count(400)
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [p for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(str(p) for p in loc) or None
        msg = f"{param}: {first['msg']}" if param else str(first["msg"])
        return APIError(400, msg, param=param).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        count(500)
        log.exception("internal error path=%s", request.url.path)
        return internal(e).response()
