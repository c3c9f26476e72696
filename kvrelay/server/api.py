"""OpenAI-compatible routes: chat, completions, models, health, metrics; and read-only
introspection: server_info (configuration and provenance), telemetry/steps and
telemetry/profile (how often a step is split into components). In front of them all: the API key
and the body-size limit (guard.py). PD routing fields (`kvrelay_pd`) are taken only from a caller
that holds the PD secret (the router's token over the body, handshake.request_token)."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from pydantic import ValidationError

from kvrelay import provenance
from kvrelay.config import ServerConfig, env, env_snapshot, redacted
from kvrelay.disagg.handshake import PD_AUTH_HEADER, request_token_ok
from kvrelay.disagg.protocol import PDParams
from kvrelay.engine.messages import SamplingParams
from kvrelay.server import openai_format as fmt
from kvrelay.server.chat_format import ChatFormat
from kvrelay.server.chat_output import ChatOutputParser, delta_dict, message_dict
from kvrelay.server.engine_client import EngineClient, EngineDead
from kvrelay.server.errors import APIError, bad_request, unavailable
from kvrelay.server.generation import Delta, Generation
from kvrelay.server.guard import HttpGuard
from kvrelay.server.metrics import Metrics
from kvrelay.server.schemas import ChatCompletionRequest, CompletionRequest
from kvrelay.server.telemetry import StepTelemetry
from kvrelay.server.tokenizer import load_tokenizer
from kvrelay.weights.loader import resolve

log = logging.getLogger("kvrelay.api")


class ServerState:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.src = resolve(cfg.engine.model, cfg.engine.load_format, cfg.engine.tokenizer)
        self.model_name = cfg.served_model_name or self.src.name
        self.metrics = Metrics()
        self.client = EngineClient(cfg.engine)
        self.telemetry = StepTelemetry()
        self.telemetry.profile_every = cfg.engine.step_profile_every
        self.client.on_step = self._on_step
        self.tokenizer = None
        self._info: dict | None = None

    def _on_step(self, msg) -> None:
        self.metrics.on_step(msg)
        self.telemetry.on_step(msg)

    def info(self) -> dict:
        """Configuration and provenance; computed once (none of it changes while serving)."""
        if self._info is None:
            r = self.client.ready
            self._info = {
                "model": self.model_name,
                "config": redacted(asdict(self.cfg)),
                "engine": {
                    "max_model_len": r.max_model_len,
                    "max_total_tokens": r.max_total_tokens,
                    "page_size": r.page_size,
                    "device": r.device,
                    "dtype": r.dtype,
                    "role": r.role,
                },
                "gpu": provenance.device_name(r.device),
                "versions": provenance.versions(),
                "git": provenance.git_commit(),
                "env": env_snapshot(),
            }
        return self._info

    @property
    def max_model_len(self) -> int:
        return self.client.ready.max_model_len


def create_app(cfg: ServerConfig, on_ready=None) -> FastAPI:
    state = ServerState(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tok_task = asyncio.create_task(asyncio.to_thread(load_tokenizer, state.src))
        await state.client.start(float(env("KVRELAY_ENGINE_START_TIMEOUT_S")))
        state.tokenizer = await tok_task
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
        on_reject=lambda status: state.metrics.errors.labels(status=str(status)).inc(),
    )
    pd_secret = cfg.engine.disagg.pd_secret
    if cfg.engine.role != "single" and not pd_secret:
        log.warning(
            "no PD secret (--pd-secret, --pd-secret-file or KVRELAY_PD_SECRET): this %s server "
            "refuses PD requests (403) and transfer peers",
            cfg.engine.role,
        )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        state.metrics.errors.labels(status=str(e.status)).inc()
        return e.response()

    @app.get("/health")
    async def health():
        reason = state.client.unhealthy_reason()
        if reason is not None:
            raise unavailable(reason)
        return PlainTextResponse("ok")

    @app.get("/health_generate")
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
        try:
            every = (await request.json())["every"]
        except (ValueError, KeyError, TypeError):
            raise bad_request('the body must be {"every": N}') from None
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise bad_request("every must be a non-negative integer")
        try:
            await state.client.set_step_profile(every)
        except EngineDead as e:
            raise unavailable(str(e)) from None
        previous, state.telemetry.profile_every = state.telemetry.profile_every, every
        return {"every": every, "previous": previous}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(state.metrics.registry).decode())

    @app.get("/v1/models")
    async def models():
        card = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvrelay",
            "max_model_len": state.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await _parse(request, ChatCompletionRequest)
        _check_common(req)
        chat_format = ChatFormat(state.src.config.architecture, state.tokenizer)
        try:  # off the event loop: a long prompt must not stall other requests' streams
            prompt_ids = await asyncio.to_thread(chat_format.prompt_ids, req)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        gen = _start(req, prompt_ids)
        rid, created = gen.rid, int(gen.created)
        parser = chat_format.output_parser(req, f"call_{uuid.uuid4().hex[:16]}_")
        if req.stream:
            return _stream(
                request,
                gen,
                lambda d, first: _chat_chunk(rid, created, d, first, req, parser),
                rid,
                created,
                "chat.completion.chunk",
                req,
            )
        deltas = await _collect(request, gen)
        text = "".join(d.text for d in deltas)
        message = {"role": "assistant", "content": text}
        if parser is not None:
            message = message_dict(parser.step(text, final=True), parser.reasoning)
            _log_parse_errors(rid, parser)
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": _finish_reason(deltas[-1].finish_reason, parser),
            "logprobs": None,
        }
        if req.logprobs:
            choice["logprobs"] = fmt.chat_logprobs(state.tokenizer, deltas)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": state.model_name,
            "choices": [choice],
            "usage": fmt.usage(len(prompt_ids), gen.completion_tokens),
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        _check_common(req)
        prompt = req.prompt
        prompt_ids = (
            list(prompt)
            if isinstance(prompt, list)
            else await asyncio.to_thread(state.tokenizer.encode, prompt, add_special_tokens=False)
        )
        if not prompt_ids:
            raise bad_request("prompt is empty", "prompt")
        gen = _start(req, prompt_ids)
        rid, created = gen.rid, int(gen.created)
        echo = (
            (prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt_ids))
            if req.echo
            else ""
        )
        if req.stream:
            offset = [0]  # text offset of the next token, across chunks
            return _stream(
                request,
                gen,
                lambda d, first: _completion_chunk(rid, created, d, first, req, echo, offset),
                rid,
                created,
                "text_completion",
                req,
            )
        deltas = await _collect(request, gen)
        choice = {
            "index": 0,
            "text": echo + "".join(d.text for d in deltas),
            "finish_reason": deltas[-1].finish_reason,
            "logprobs": None,
        }
        if req.logprobs is not None:
            choice["logprobs"] = fmt.completion_logprobs(state.tokenizer, deltas, len(echo))
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": [choice],
            "usage": fmt.usage(len(prompt_ids), gen.completion_tokens),
        }

    async def _parse(request: Request, schema):
        body = await request.body()  # the guard has held it to cfg.max_body_bytes
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"malformed JSON: {e}") from None
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        if "kvrelay_pd" in data:  # before anything acts on it (a prefill would connect)
            _check_pd_auth(request, body)
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err["loc"]) or None
            raise bad_request(f"{param}: {err['msg']}" if param else err["msg"], param) from None

    def _check_pd_auth(request: Request, body: bytes) -> None:
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

    def _check_common(req) -> None:
        if not state.client.healthy:
            raise unavailable(state.client.dead_reason or "engine not ready")
        if req.model != state.model_name:
            raise APIError(
                404,
                f"model {req.model!r} does not exist; this server serves {state.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if req.n > cfg.max_n:
            raise bad_request(f"n={req.n} is not supported (at most {cfg.max_n})", "n")

    def _start(req, prompt_ids: list[int]) -> Generation:
        limit = state.max_model_len
        if len(prompt_ids) >= limit:
            raise bad_request(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {limit}",
                "messages",
            )
        max_tokens = req.max_tokens if req.max_tokens is not None else limit - len(prompt_ids)
        if len(prompt_ids) + max_tokens > limit:
            raise bad_request(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context length {limit}",
                "max_tokens",
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=max(req.top_k, 0),
            min_p=req.min_p,
            seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=req.num_logprobs,
        )
        rid = (
            f"{'chatcmpl' if isinstance(req, ChatCompletionRequest) else 'cmpl'}-{uuid.uuid4().hex}"
        )
        pd, pd_rid = _pd_params(req)
        if pd is not None:
            rid = pd_rid or rid
            if rid in state.client.queues:
                raise APIError(409, f"request id {rid} is already in flight", param="kvrelay_pd")
        return Generation(
            state.client,
            state.tokenizer,
            rid,
            prompt_ids,
            params,
            req.stop_strings,
            state.metrics,
            cfg.request_timeout_s,
            pd=pd,
        )

    async def _collect(request: Request, gen: Generation) -> list[Delta]:
        """Run to completion, aborting the request if the client goes away first."""

        async def run():
            return [d async for d in gen.deltas()]

        task = asyncio.create_task(run())
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
        try:
            return task.result()
        except EngineDead as e:
            raise unavailable(str(e)) from None

    def _stream(request, gen, make_chunk, rid, created, obj, req):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events():
            first = True
            try:
                async for d in gen.deltas():
                    chunk = make_chunk(d, first)
                    if chunk is not None:  # None: nothing to say yet (a parser holds text)
                        yield f"data: {json.dumps(chunk)}\n\n"
                    first = False
            except (APIError, EngineDead) as e:
                msg = e.message if isinstance(e, APIError) else str(e)
                err = {"message": msg, "type": "server_error", "code": getattr(e, "code", None)}
                yield f"data: {json.dumps({'error': err})}\n\n"
                return
            if include_usage:
                body = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": state.model_name,
                    "choices": [],
                    "usage": fmt.usage(len(gen.prompt_ids), gen.completion_tokens),
                }
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def _chat_chunk(
        rid, created, d: Delta, first: bool, req, parser: ChatOutputParser | None
    ) -> dict | None:
        if parser is None:
            delta = {"content": d.text}
        else:
            delta = delta_dict(parser.step(d.text, final=d.finish_reason is not None))
            if d.finish_reason:
                _log_parse_errors(rid, parser)
            if not (delta or first or d.finish_reason or (req.logprobs and d.token_ids)):
                return None
        if first:
            delta = {"role": "assistant", **delta}
        reason = _finish_reason(d.finish_reason, parser)
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        if req.logprobs and d.token_ids:
            choice["logprobs"] = fmt.chat_logprobs(state.tokenizer, [d])
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.model_name,
            "choices": [choice],
        }

    def _completion_chunk(
        rid, created, d: Delta, first: bool, req, echo: str, offset: list[int]
    ) -> dict:
        text = (echo if first else "") + d.text
        choice = {"index": 0, "text": text, "finish_reason": d.finish_reason, "logprobs": None}
        if req.logprobs is not None and d.token_ids:
            choice["logprobs"] = fmt.completion_logprobs(
                state.tokenizer, [d], offset[0] + len(echo) * first
            )
        offset[0] += len(text)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": [choice],
        }

    return app


def _finish_reason(reason: str | None, parser: ChatOutputParser | None) -> str | None:
    return "tool_calls" if reason and parser is not None and parser.tool_calls else reason


def _log_parse_errors(rid: str, parser: ChatOutputParser) -> None:
    if parser.errors:
        log.warning("tool call parse errors rid=%s errors=%s", rid, "; ".join(parser.errors))


def _pd_params(req) -> tuple[PDParams | None, str | None]:
    """The router's `kvrelay_pd` body field: {role, transfer_id, request_id, decode_addr, decode_instance}."""
    raw = (req.model_extra or {}).get("kvrelay_pd")
    if raw is None:
        return None, None
    try:
        pd = msgspec.convert(raw, PDParams)
    except msgspec.ValidationError as e:
        raise bad_request(f"kvrelay_pd: {e}", "kvrelay_pd") from None
    if pd.role not in ("prefill", "decode") or not pd.transfer_id:
        raise bad_request("kvrelay_pd needs role prefill|decode and a transfer_id", "kvrelay_pd")
    if pd.role == "prefill" and not pd.decode_addr:
        raise bad_request("kvrelay_pd: a prefill request needs decode_addr", "kvrelay_pd")
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return pd, rid if isinstance(rid, str) and rid else None
