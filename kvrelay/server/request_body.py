"""A generating route's JSON body, read once: strict JSON (validation.py), and a `kvrelay_pd`
field in it taken only with the router's signature over the exact bytes (handshake.py), checked
before anything acts on it (a prefill would connect to decode)."""

from __future__ import annotations

import logging

from fastapi import Request

from kvrelay.disagg.handshake import PD_AUTH_HEADER, request_token_ok
from kvrelay.server.errors import APIError
from kvrelay.server.validation import parse_json, validate

log = logging.getLogger("kvrelay.api")


async def body_data(request: Request, pd_secret: str) -> dict:
    """The JSON body; a PD field in it must carry the router's signature."""
    body = await request.body()  # the guard has held it to cfg.max_body_bytes
    data = parse_json(body)
    if "kvrelay_pd" in data:
        check_pd_auth(request, body, pd_secret)
    return data


async def parse(request: Request, schema, pd_secret: str):
    return validate(schema, await body_data(request, pd_secret))


def check_pd_auth(request: Request, body: bytes, pd_secret: str) -> None:
    if not pd_secret:
        raise APIError(
            403,
            "kvrelay_pd is refused: this server has no PD secret (--pd-secret)",
            type_="permission_error",
            param="kvrelay_pd",
            code="pd_secret_missing",
        )
    if not request_token_ok(pd_secret, body, request.headers.get(PD_AUTH_HEADER)):
        log.warning(
            "PD fields refused client=%s cause=pd_auth_failed",
            request.client.host if request.client else "?",
        )
        raise APIError(
            403,
            f"kvrelay_pd is accepted only from the router: the {PD_AUTH_HEADER} header "
            "must sign the body with the PD secret",
            type_="permission_error",
            param="kvrelay_pd",
            code="pd_auth_failed",
        )
