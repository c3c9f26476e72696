"""The server's app: its lifespan (engine and tokenizer up, then chat format), the API key and
body-size limit in front of every route (guard.py), OpenAI-format errors, and the route modules
registered on one ServerState (state.py):
- probe_routes: /health, /ready, /load, /health_generate
- utility_routes: /tokenize, /detokenize, /version, /ping
- introspection_routes: /pd/info, /server_info, /telemetry/*, /metrics, /v1/models
- serving_chat, serving_completions, serving_generate: the generating routes (request building
  in request_building.py, running and streaming in serving.py).
PD routing fields (`kvrelay_pd`) are taken only from a caller that holds the PD secret (the
router's token over the body: request_body.py)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvrelay.config import ServerConfig, env
from kvrelay.server import (
    introspection_routes,
    probe_routes,
    serving_chat,
    serving_completions,
    serving_generate,
    utility_routes,
)
from kvrelay.server.chat_format import ChatFormat
from kvrelay.server.errors import install_error_handlers
from kvrelay.server.guard import HttpGuard
from kvrelay.server.openapi_doc import document_bodies
from kvrelay.server.schemas import ChatCompletionRequest, CompletionRequest
from kvrelay.server.sglang_api import GenerateRequest
from kvrelay.server.state import ServerState
from kvrelay.weights.tokenizer import load_tokenizer

log = logging.getLogger("kvrelay.api")


def create_app(cfg: ServerConfig, on_ready=None) -> FastAPI:
    state = ServerState(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tok_task = asyncio.create_task(asyncio.to_thread(load_tokenizer, state.src))
        await state.client.start(float(env("KVRELAY_ENGINE_START_TIMEOUT_S")))
        state.tokenizer = await tok_task
        state.chat_format = await asyncio.to_thread(
            ChatFormat, state.src.config.architecture, state.tokenizer
        )
        log.info("server ready model=%s max_model_len=%d", state.model_name, state.max_model_len)
        if on_ready is not None:
            on_ready(state)
        yield
        await state.client.shutdown()

    app = FastAPI(title="kvrelay", lifespan=lifespan)
    app.state.kv = state
    app.add_middleware(
        HttpGuard,
        api_key=cfg.api_key,
        max_body_bytes=cfg.max_body_bytes,
        on_reject=state.count_error,
    )
    if cfg.engine.role != "single" and not state.pd_secret:
        log.warning(
            "no PD secret (--pd-secret, --pd-secret-file or KVRELAY_PD_SECRET): this %s server "
            "refuses PD requests (403) and transfer peers",
            cfg.engine.role,
        )
    install_error_handlers(app, state.count_error)

    # In this order: it is the order of the OpenAPI document's paths.
    probe_routes.register(app, state)
    utility_routes.register(app, state)
    introspection_routes.register(app, state)
    serving_chat.register(app, state)
    serving_completions.register(app, state)
    serving_generate.register(app, state)

    generating = {
        ("POST", "/v1/chat/completions"): ChatCompletionRequest,
        ("POST", "/v1/completions"): CompletionRequest,
        ("POST", "/generate"): GenerateRequest,
    }
    document_bodies(
        app,
        {
            **generating,
            ("POST", "/telemetry/profile"): introspection_routes.StepProfileRequest,
            ("POST", "/tokenize"): utility_routes.TokenizeRequest,
            ("POST", "/detokenize"): utility_routes.DetokenizeRequest,
        },
        frozenset(generating),
    )
    return app
