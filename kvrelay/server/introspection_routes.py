"""Read-only introspection, and the one knob a benchmark turns: `/pd/info` (what a PD router
pairs by), `/server_info` (configuration and provenance), `/telemetry/steps`,
`/telemetry/profile` (how often a step is split into components; POST sets it), `/metrics`
(Prometheus) and `/v1/models` (the served model's card)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field

from kvrelay.server.engine_client import EngineDead
from kvrelay.server.errors import APIError, bad_request, unavailable
from kvrelay.server.request_body import parse
from kvrelay.server.schemas import INT32_MAX
from kvrelay.server.state import ServerState


class StepProfileRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    every: int = Field(strict=True, ge=0, le=INT32_MAX, description="every N-th step; 0: off")


def register(app: FastAPI, state: ServerState) -> None:
    @app.get("/pd/info")
    async def pd_info():
        """What a PD router needs: this server's role, engine instance id, KV transfer address
        and cache layout fingerprint (what both sides of a pair must share)."""
        r = state.client.ready
        if r is None:
            raise unavailable("engine not ready")
        return {
            "role": r.role,
            "instance_id": r.instance_id,
            "transfer_addr": r.transfer_addr,
            "layout": r.transfer_layout,
            "model": state.model_name,
        }

    @app.get("/server_info")
    async def server_info():
        if state.client.ready is None:
            raise unavailable("engine not ready")
        return await asyncio.to_thread(state.info)  # git and device lookups block

    @app.get("/telemetry/steps")
    async def telemetry_steps(since: int = 0, limit: int | None = None):
        """Engine steps numbered `since` and later: batch size, tokens, step_ms, prefill count."""
        if since < 0 or (limit is not None and limit < 0):
            raise bad_request("since and limit must not be negative")
        return state.telemetry.since(since, limit)

    @app.get("/telemetry/profile")
    async def get_step_profile():
        """How often the engine splits a step into components (0: never)."""
        return {"every": state.telemetry.profile_every}

    @app.post("/telemetry/profile")
    async def set_step_profile(request: Request):
        """{"every": N}: profile every N-th engine step from now on (0: off). Returns the new
        and the previous setting (a benchmark restores what it found)."""
        every = (await parse(request, StepProfileRequest, state.pd_secret)).every
        try:
            await state.client.set_step_profile(every)
        except EngineDead as e:
            raise unavailable(str(e)) from None
        previous, state.telemetry.profile_every = state.telemetry.profile_every, every
        return {"every": every, "previous": previous}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(generate_latest(state.metrics.registry).decode())

    def model_card() -> dict:
        return {
            "id": state.model_name,
            "object": "model",
            "created": state.started,  # when this server started (vLLM: the card's creation)
            "owned_by": "kvrelay",
            "root": state.cfg.engine.model,  # what the weights were loaded from, as the operator said
            "parent": None,  # a base model, not a fine-tune (LoRA) of another served one
            "max_model_len": state.max_model_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_name:
            raise APIError(
                404,
                f"model {model_id!r} does not exist; this server serves {state.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return model_card()
