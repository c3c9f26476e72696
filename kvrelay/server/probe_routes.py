"""Probes: `/health` (liveness: the engine runs and its loop turns), `/ready` (readiness: this
server can serve what its role asks), `/load` (what the PD router balances by: load_report.py)
and `/health_generate` (SGLang's: one token generated)."""

from __future__ import annotations

import uuid

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from kvrelay.engine.messages import SamplingParams
from kvrelay.server import utility_routes
from kvrelay.server.engine_client import EngineDead
from kvrelay.server.errors import APIError, unavailable
from kvrelay.server.generation import Generation
from kvrelay.server.load_report import load_report
from kvrelay.server.state import ServerState


def register(app: FastAPI, state: ServerState) -> None:
    role = state.cfg.engine.role

    @app.api_route("/health", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    async def health():
        """Liveness: the engine runs and its loop turns (a busy engine is alive)."""
        return utility_routes.liveness(state)

    @app.api_route("/ready", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    async def ready():
        """Readiness: this server can serve what its role asks (a router routes to it)."""
        reason = state.client.not_ready_reason()
        if reason is None and role != "single" and not state.pd_secret:
            reason = f"a {role} server without a PD secret (--pd-secret) serves nothing"
        if reason is not None:
            raise unavailable(reason)
        return PlainTextResponse("ready")

    @app.get("/load")
    async def load():
        """Load (running, waiting, requests, queued_prompt_tokens, free_pages, total_pages), from
        what this process keeps; the API key applies as on the other non-probe routes."""
        if state.client.ready is None:
            raise unavailable("engine not ready")
        return JSONResponse(load_report(state.client))

    @app.get("/health_generate", response_class=PlainTextResponse)
    async def health_generate():
        params = SamplingParams(max_tokens=1, temperature=0.0)
        gen = Generation(
            state.client,
            state.tokenizer,
            f"health-{uuid.uuid4().hex}",
            [0],
            params,
            [],
            state.metrics,
            30.0,
        )
        try:
            async for _ in gen.deltas():
                pass
        except EngineDead as e:
            raise unavailable(str(e)) from None
        except APIError as e:
            raise unavailable(f"generation failed: {e.message}") from None
        return PlainTextResponse("ok")
