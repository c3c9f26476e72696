"""`kvrelay router`: the OpenAI-compatible front of a PD deployment (routing.py routes each
request). With an API key, clients must send it (guard.py) and the router sends it to the
servers. Bodies are validated as the servers do (server/validation.py) before anything is routed,
and every answer, 404 and 500 included, is an OpenAI error; what never reached routing is
counted as outcome http_<status>. Batches and n > 1 become one PD request per prompt and sample
(fanout.py). Read-only routes (models, version, tokenize) are answered by a decode server.
`/health` says the router is alive; `/ready` says it can serve (its PD secret is set and at least
one prefill and one decode server answered their own `/ready` in the last background probe).
Both answer from state the router keeps (probe.py), never from a request behind traffic.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import asdict
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest

from kvrelay.config import RouterConfig, redacted
from kvrelay.router import fanout
from kvrelay.router import metrics as router_metrics
from kvrelay.router.routing import RouteError, Router
from kvrelay.server import prompt_logprobs
from kvrelay.server.errors import install_error_handlers
from kvrelay.server.guard import HttpGuard
from kvrelay.server.openapi_doc import document_bodies
from kvrelay.server.schemas import ChatCompletionRequest, CompletionRequest
from kvrelay.server.sglang_api import GenerateRequest
from kvrelay.server.validation import parse_json, validate

log = logging.getLogger("kvrelay.router")


def create_router_app(cfg: RouterConfig, on_ready=None) -> FastAPI:
    router = Router(cfg)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is ours, with ids

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        router.probe.start()
        if on_ready is not None:
            on_ready()
        yield
        await router.probe.close()
        await router.lanes.aclose()

    app = FastAPI(title="kvrelay router", lifespan=lifespan)
    app.state.router = router

    def count(status: int) -> None:
        router.requests.labels(outcome=f"http_{status}").inc()

    app.add_middleware(
        HttpGuard, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes, on_reject=count
    )
    install_error_handlers(app, count)
    if not cfg.pd_secret:
        log.warning(
            "no PD secret (--pd-secret, --pd-secret-file or KVRELAY_PD_SECRET): every request "
            "is answered 503, the servers would refuse it"
        )

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        """Liveness: the router answers. Its servers' last probe is shown, not waited for."""
        return JSONResponse({"status": "alive", "servers": router.probe.snapshot()})

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready():
        """Readiness: the router can route (secret set, a prefill and a decode server ready)."""
        why = router.not_ready()
        if why:
            return RouteError(503, "; ".join(why), "not_ready").response()
        return JSONResponse({"status": "ready", "servers": router.probe.snapshot()})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        """The router's metrics, then its servers' (router/metrics.py: relabelled per server,
        each fetched within a short timeout)."""
        own = generate_latest(router.registry).decode()
        servers = [(u, "prefill") for u in cfg.prefill] + [(u, "decode") for u in cfg.decode]
        return PlainTextResponse(own + await router_metrics.servers_text(router.client, servers))

    @app.api_route("/ping", methods=["GET", "POST"], response_class=PlainTextResponse)
    async def ping():
        """Liveness (vLLM's /ping), as /health."""
        return PlainTextResponse("ok")

    async def from_decode(path: str, body: bytes | None = None) -> Response:
        """A read-only request answered by a decode server (they all serve one model and one
        tokenizer): the first ready one at the last probe."""
        url = (router.probe.ready_urls("decode") or cfg.decode)[0] + path
        try:
            if body is None:
                r = await router.client.get(url)
            else:
                headers = {"Content-Type": "application/json"}
                r = await router.client.post(url, content=body, headers=headers)
        except httpx.HTTPError as e:
            return RouteError(
                503, f"decode server unreachable: {e}", "decode_unreachable"
            ).response()
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/v1/models")
    async def models():
        return await from_decode("/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return await from_decode(f"/v1/models/{quote(model_id, safe='')}")

    @app.get("/version")
    async def version():
        return await from_decode("/version")

    @app.get("/server_info")
    async def server_info():
        """The router's configuration (secrets redacted) and each server's own /server_info
        (or why it could not be had): what `kvrelay repro --deterministic-check` and the ledger
        read through a router."""

        async def one(url: str):
            try:
                r = await router.client.get(url + "/server_info", timeout=cfg.connect_timeout_s)
                return r.json() if r.status_code == 200 else {"error": f"HTTP {r.status_code}"}
            except (httpx.HTTPError, ValueError) as e:
                return {"error": f"{type(e).__name__}: {e}"}

        urls = [*cfg.prefill, *cfg.decode]
        infos = await asyncio.gather(*(one(u) for u in urls))
        return {
            "role": "router",
            "config": redacted(asdict(cfg)),
            "servers": dict(zip(urls, infos, strict=True)),
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await from_decode("/tokenize", await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await from_decode("/detokenize", await request.body())

    async def _body(request: Request, schema) -> tuple[dict, object]:
        """The client's body, validated as the servers will (a 400 here costs no pair)."""
        body = parse_json(await request.body())
        body.pop("kvrelay_pd", None)  # only the router sets it
        req = validate(schema, body)
        if schema is not GenerateRequest:
            prompt_logprobs.check(req)  # what one server refuses, refused before routing
        return body, req

    async def handle(path: str, request: Request, schema) -> Response:
        """One PD request, or one per prompt and sample (fanout.py); a completion that
        generates nothing (max_tokens 0: the prompt's scores alone) is prefill's alone."""
        body, req = await _body(request, schema)
        route = router.route_prefill_only if body.get("max_tokens") == 0 else router.route
        subs = fanout.split(path, body, req)
        if subs is None:
            return await route(path, body, request)
        n = getattr(req, "n", 1)
        return await fanout.run(path, body, subs, n, lambda b: route(path, b, request))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle("/v1/chat/completions", request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("/v1/completions", request, CompletionRequest)

    @app.post("/generate")
    async def generate(request: Request):
        """SGLang's native generate, disaggregated like the OpenAI routes."""
        return await handle("/generate", request, GenerateRequest)

    routes = {
        ("POST", "/v1/chat/completions"): ChatCompletionRequest,
        ("POST", "/v1/completions"): CompletionRequest,
        ("POST", "/generate"): GenerateRequest,
    }
    document_bodies(app, routes, frozenset(routes))
    return app
