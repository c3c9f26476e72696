"""OpenAI-compatible routes: chat, completions, models, health, metrics; and read-only
introspection: server_info (configuration and provenance), telemetry/steps and
telemetry/profile (how often a step is split into components). In front of them all: the API key
and the body-size limit (guard.py). PD routing fields (`kvrelay_pd`) are taken only from a caller
that holds the PD secret (the router's token over the body, handshake.request_token)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field

from kvrelay import provenance
from kvrelay.config import ServerConfig, env, env_snapshot, redacted
from kvrelay.disagg.handshake import PD_AUTH_HEADER, request_token_ok
from kvrelay.disagg.protocol import PDParams
from kvrelay.engine.messages import SamplingParams
from kvrelay.server import openai_format as fmt
from kvrelay.server import prompt_logprobs as plp
from kvrelay.server import sglang_api as sglang
from kvrelay.server import structured, utility_routes
from kvrelay.server.chat_format import ChatFormat, UnsupportedField
from kvrelay.server.chat_output import ChatOutputParser, delta_dict, message_dict
from kvrelay.server.engine_client import EngineClient, EngineDead
from kvrelay.server.errors import (
    APIError,
    bad_request,
    install_error_handlers,
    internal,
    unavailable,
)
from kvrelay.server.generation import Delta, Generation
from kvrelay.server.generation_defaults import model_defaults
from kvrelay.server.generation_defaults import resolve as resolve_sampling
from kvrelay.server.guard import HttpGuard
from kvrelay.server.metrics import Metrics
from kvrelay.server.openapi_doc import document_bodies
from kvrelay.server.schemas import (
    INT32_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    child_seed,
)
from kvrelay.server.sglang_api import GenerateRequest
from kvrelay.server.telemetry import StepTelemetry
from kvrelay.server.validation import parse_json, validate
from kvrelay.weights.loader import resolve
from kvrelay.weights.tokenizer import load_tokenizer

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
        self.chat_format: ChatFormat | None = None
        self.sampling_defaults = model_defaults(cfg.generation_config, self.src)
        self._info: dict | None = None
        self.started = int(time.time())

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
        on_reject=lambda status: state.metrics.errors.labels(status=str(status)).inc(),
    )
    pd_secret = cfg.engine.disagg.pd_secret
    if cfg.engine.role != "single" and not pd_secret:
        log.warning(
            "no PD secret (--pd-secret, --pd-secret-file or KVRELAY_PD_SECRET): this %s server "
            "refuses PD requests (403) and transfer peers",
            cfg.engine.role,
        )

    def count_error(status: int) -> None:
        state.metrics.errors.labels(status=str(status)).inc()

    install_error_handlers(app, count_error)

    @app.api_route("/health", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    async def health():
        """Liveness: the engine runs and its loop turns (a busy engine is alive)."""
        return utility_routes.liveness(state)

    @app.api_route("/ready", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    async def ready():
        """Readiness: this server can serve what its role asks (a router routes to it)."""
        reason = state.client.not_ready_reason()
        if reason is None and cfg.engine.role != "single" and not pd_secret:
            reason = f"a {cfg.engine.role} server without a PD secret (--pd-secret) serves nothing"
        if reason is not None:
            raise unavailable(reason)
        return PlainTextResponse("ready")

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

    utility_routes.register(app, state)  # /tokenize, /detokenize, /version, /ping

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
        every = (await _parse(request, StepProfileRequest)).every
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
            "root": cfg.engine.model,  # what the weights were loaded from, as the operator said
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

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await _parse(request, ChatCompletionRequest)
        _check_common(req)
        chat_format = state.chat_format
        try:  # off the event loop: a long prompt must not stall other requests' streams
            prompt_ids = await asyncio.to_thread(chat_format.prompt_ids, req)
        except UnsupportedField as e:
            raise bad_request(str(e), e.param) from None
        except (ValueError, TypeError, TemplateError) as e:  # what the messages made it raise
            raise bad_request(f"the messages cannot be rendered: {e}", "messages") from None
        prompt_ids = _truncate(req, prompt_ids)
        grammar = await asyncio.to_thread(structured.chat_grammar, req, chat_format)
        gens = _start_n(req, prompt_ids, grammar)
        rid, created = gens[0].rid, int(gens[0].created)
        parsers = [chat_format.output_parser(req, f"call_{uuid.uuid4().hex[:16]}_") for _ in gens]
        if req.stream:
            return _stream(
                request,
                gens,
                lambda i, d, first: _chat_chunk(rid, created, i, d, first, req, parsers[i]),
                rid,
                created,
                "chat.completion.chunk",
                req,
            )
        choices = []
        outputs = await _collect(request, gens)
        for i, (deltas, parser) in enumerate(zip(outputs, parsers, strict=True)):
            text = "".join(d.text for d in deltas)
            message = {"role": "assistant", "content": text}
            cut = deltas[-1].finish_reason == "length"
            if parser is not None:
                message = message_dict(parser.step(text, True, cut), parser.reasoning)
                _log_parse_errors(rid, parser)
            choice = {
                "index": i,
                "message": message,
                "finish_reason": _finish_reason(deltas[-1].finish_reason, parser),
                "logprobs": None,
            }
            if req.logprobs:
                choice["logprobs"] = fmt.chat_logprobs(
                    state.tokenizer, deltas, req.return_tokens_as_token_ids
                )
            choices.append(choice)
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
            "usage": _usage(prompt_ids, gens),
        }
        if req.prompt_logprobs is not None:  # vLLM puts them beside the choices on chat
            body["prompt_logprobs"] = await _vllm_prompt_logprobs(req, prompt_ids, outputs[0])
        return body

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        _check_common(req)
        if len(req.prompts) > 1 and "kvrelay_pd" in (req.model_extra or {}):
            raise bad_request(
                "a PD request carries one prompt (the router splits batches)", "prompt"
            )
        grammar = await asyncio.to_thread(structured.completion_grammar, req)
        prompts = [await _completion_prompt(req, p) for p in req.prompts]  # (echo, ids) each
        groups = [_start_n(req, ids, grammar) for _, ids in prompts]
        # Flat, in choice order: index = prompt_i * n + sample_j.
        items = [(g, *prompts[i]) for i, group in enumerate(groups) for g in group]
        gens = [g for g, _, _ in items]
        rid, created = gens[0].rid, int(gens[0].created)
        if req.stream:
            offsets = [[0] for _ in gens]  # each choice's text offset of its next token
            return _stream(
                request,
                gens,
                lambda i, d, first: _completion_chunk(
                    rid, created, i, d, first, req, items[i][1], offsets[i], items[i][2]
                ),
                rid,
                created,
                "text_completion",
                req,
                usage=lambda: _batch_usage(groups),
            )
        choices = []
        for i, deltas in enumerate(await _collect(request, gens)):
            _, echo, prompt_ids = items[i]
            choice = {
                "index": i,
                "text": echo + "".join(d.text for d in deltas),
                "finish_reason": deltas[-1].finish_reason,
                "logprobs": None,
            }
            # Off the event loop: a long prompt's entries take a while to decode and shape.
            if req.logprobs is not None:
                choice["logprobs"] = await asyncio.to_thread(
                    _completion_logprobs, req, deltas, len(echo), prompt_ids, True
                )
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = await _vllm_prompt_logprobs(req, prompt_ids, deltas)
            choices.append(choice)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
            "usage": _batch_usage(groups),
        }

    async def _completion_prompt(req, prompt) -> tuple[str, list[int]]:
        """One prompt of a completions request: (its echo text, its token ids)."""
        ids = (
            list(prompt)
            if isinstance(prompt, list)
            else await asyncio.to_thread(state.tokenizer.encode, prompt, add_special_tokens=False)
        )
        if not ids:
            raise bad_request("prompt is empty", "prompt")
        truncated = _truncate(req, ids)
        if len(truncated) < len(ids):
            prompt, ids = truncated, truncated  # echo shows what the model read
        if not req.echo:
            return "", ids
        return (prompt if isinstance(prompt, str) else state.tokenizer.decode(ids)), ids

    async def _vllm_prompt_logprobs(req, prompt_ids: list[int], deltas) -> list | None:
        """vLLM's prompt_logprobs of one choice; None from a PD decode server, which never
        runs the prompt: the router puts prefill's in (router_prompt_logprobs.py)."""
        if _scored_elsewhere(req):
            return None
        return await asyncio.to_thread(plp.vllm, state.tokenizer, prompt_ids, plp.first(deltas))

    @app.post("/generate")
    async def generate(request: Request):
        """SGLang's native generate (sglang_api.py): one prompt or a batch."""
        data = await _body_data(request)
        pd = data.pop("kvrelay_pd", None)  # SGLang's body forbids unknown fields: kept aside
        req = validate(GenerateRequest, data)
        if pd is not None and req.is_batch:
            raise bad_request("a PD request carries one prompt (the router splits batches)", "text")
        grammar = await asyncio.to_thread(structured.sglang_grammar, req.sampling_params)
        items = []
        for prompt in req.prompts:
            if isinstance(prompt, list):
                prompt_ids = list(prompt)
            else:
                prompt_ids = await asyncio.to_thread(state.tokenizer.encode, prompt)
                if not prompt_ids:
                    raise bad_request("text is empty", "text")
            view = sglang.SamplingView.of(req, pd, len(prompt_ids))
            _check_ready(view)
            try:
                shaper = sglang.logprobs_of(req, state.tokenizer, prompt_ids)
            except ValueError as e:
                raise bad_request(str(e), "logprob_start_len") from None
            gen = _start(view, prompt_ids, "generate", grammar=grammar)
            rid = req.rid if req.rid and not req.is_batch else gen.rid  # a batch: one id each
            items.append(sglang.Item(gen, rid, shaper))
        gens = [it.gen for it in items]
        if req.stream:
            return StreamingResponse(
                sglang.events(items, req.is_batch, _merged(gens), stream_error),
                media_type="text/event-stream",
            )
        start = gens[0].created
        outputs = await _collect(request, gens)
        answers = [sglang.answer(it, out, start) for it, out in zip(items, outputs, strict=True)]
        return answers if req.is_batch else answers[0]

    async def _body_data(request: Request) -> dict:
        """The JSON body; a PD field in it must carry the router's signature."""
        body = await request.body()  # the guard has held it to cfg.max_body_bytes
        data = parse_json(body)
        if "kvrelay_pd" in data:  # before anything acts on it (a prefill would connect)
            _check_pd_auth(request, body)
        return data

    async def _parse(request: Request, schema):
        return validate(schema, await _body_data(request))

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
        if req.model != state.model_name:
            raise APIError(
                404,
                f"model {req.model!r} does not exist; this server serves {state.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if req.n > cfg.max_n:
            raise bad_request(f"n={req.n} is not supported (at most {cfg.max_n})", "n")
        if req.n > 1 and "kvrelay_pd" in (req.model_extra or {}):
            raise bad_request("a PD request carries one sample (the router splits n > 1)", "n")
        plp.check(req)
        _check_ready(req)

    def _check_ready(req) -> None:
        if not state.client.healthy:
            raise unavailable(state.client.dead_reason or "engine not ready")
        vocab = state.src.config.vocab_size
        for i, t in enumerate(req.stop_token_ids or ()):
            if t >= vocab:
                raise bad_request(
                    f"stop_token_ids[{i}]: {t} is outside the vocabulary (size {vocab})",
                    f"stop_token_ids[{i}]",
                )

    def _start(
        req,
        prompt_ids: list[int],
        prefix: str | None = None,
        grammar: str | None = None,
        index: int = 0,
        rid: str | None = None,
    ) -> Generation:
        """One engine request; sample `index` of n gets seed + index (as vLLM's children do)."""
        limit = state.max_model_len
        if len(prompt_ids) >= limit:
            raise bad_request(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {limit}",
                "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        max_tokens = req.max_tokens if req.max_tokens is not None else limit - len(prompt_ids)
        if len(prompt_ids) + max_tokens > limit:
            raise bad_request(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context length {limit}",
                "max_tokens",
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            **resolve_sampling(req, state.sampling_defaults),
            seed=None if req.seed is None else child_seed(req.seed, index),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=req.num_logprobs,
            grammar=grammar,
            prompt_logprobs=None if _scored_elsewhere(req) else plp.wanted(req),
            min_tokens=getattr(req, "min_tokens", 0),
        )
        prefix = prefix or ("chatcmpl" if isinstance(req, ChatCompletionRequest) else "cmpl")
        rid = rid or f"{prefix}-{uuid.uuid4().hex}"
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
            min_tokens=getattr(req, "min_tokens", 0),
            include_stop=getattr(req, "include_stop_str_in_output", False),
        )

    def _truncate(req, prompt_ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last N tokens of the prompt."""
        n = req.truncate_prompt_tokens
        return prompt_ids if n is None or len(prompt_ids) <= n else prompt_ids[-n:]

    def _start_n(req, prompt_ids: list[int], grammar: str | None) -> list[Generation]:
        """The request's n samples: engine requests <id>, <id>-1, ... (one response id), one
        group: the engine prefills the prompt once and the other samples share its KV."""
        first = _start(req, prompt_ids, grammar=grammar)
        rest = [
            _start(req, prompt_ids, grammar=grammar, index=i, rid=f"{first.rid}-{i}")
            for i in range(1, req.n)
        ]
        gens = [first, *rest]
        if len(gens) > 1:
            for g in gens:
                g.group = first.rid
        return gens

    async def _collect(request: Request, gens: list[Generation]) -> list[list[Delta]]:
        """Run every generation to completion, aborting them all if the client goes away."""

        async def run(gen: Generation) -> list[Delta]:
            return [d async for d in gen.deltas()]

        task = asyncio.ensure_future(asyncio.gather(*(run(g) for g in gens)))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    raise APIError(499, "client disconnected")
        finally:
            if not task.done():  # the client left, or this handler was cancelled (the router)
                task.cancel()
                # Its CancelledError is expected: retrieved, not logged as an unhandled error.
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            return task.result()
        except EngineDead as e:
            raise unavailable(str(e)) from None

    def stream_error(e: Exception, rid: str) -> str:
        """An exception in a stream that has begun: counted, logged, and sent as an SSE error
        event (the caller then ends the stream with [DONE], as OpenAI's clients expect)."""
        if isinstance(e, EngineDead):
            e = unavailable(str(e))
        elif not isinstance(e, APIError):
            log.exception("stream failed rid=%s", rid)
            e = internal(e)
        count_error(e.status)
        log.warning("stream error rid=%s status=%d message=%s", rid, e.status, e.message)
        return e.sse()

    def _stream(request, gens, make_chunk, rid, created, obj, req, usage=None):
        """SSE chunks of every generation as they come (`make_chunk(index, delta, first)`),
        then usage if asked (`usage()`: the request's; default: one prompt's n samples), then
        [DONE]."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        usage = usage or (lambda: _usage(gens[0].prompt_ids, gens))

        async def events():
            first = [True] * len(gens)
            try:
                async for i, d in _merged(gens):
                    chunk = make_chunk(i, d, first[i])
                    if chunk is not None:  # None: nothing to say yet (a parser holds text)
                        yield f"data: {json.dumps(chunk)}\n\n"
                    first[i] = False
            except Exception as e:
                yield stream_error(e, rid)
                yield "data: [DONE]\n\n"
                return
            if include_usage:
                body = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": state.model_name,
                    "choices": [],
                    "usage": usage(),
                }
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def _chat_chunk(
        rid, created, index: int, d: Delta, first: bool, req, parser: ChatOutputParser | None
    ) -> dict | None:
        if parser is None:
            delta = {"content": d.text}
        else:
            delta = delta_dict(
                parser.step(d.text, d.finish_reason is not None, d.finish_reason == "length")
            )
            if d.finish_reason:
                _log_parse_errors(rid, parser)
            if not (delta or first or d.finish_reason or (req.logprobs and d.token_ids)):
                return None
        if first:
            delta = {"role": "assistant", **delta}
        reason = _finish_reason(d.finish_reason, parser)
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
        if req.logprobs and d.token_ids:
            choice["logprobs"] = fmt.chat_logprobs(
                state.tokenizer, [d], req.return_tokens_as_token_ids
            )
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.model_name,
            "choices": [choice],
        }

    def _completion_logprobs(
        req, deltas: list[Delta], offset: int, prompt_ids: list[int], first: bool
    ) -> dict:
        """Legacy `logprobs` of these deltas' tokens (from text offset `offset`), led by the
        prompt's with echo (in the first chunk of a stream)."""
        as_ids = req.return_tokens_as_token_ids
        out = fmt.completion_logprobs(state.tokenizer, deltas, offset, as_ids)
        if req.echo and first and not _scored_elsewhere(req):
            entries = plp.first(deltas)
            prompt = plp.legacy(state.tokenizer, prompt_ids, entries, req.logprobs, as_ids)
            out = plp.merge(prompt, out)
        return out

    def _completion_chunk(
        rid, created, index, d: Delta, first: bool, req, echo: str, offset: list[int], prompt_ids
    ) -> dict:
        text = (echo if first else "") + d.text
        choice = {"index": index, "text": text, "finish_reason": d.finish_reason, "logprobs": None}
        if req.logprobs is not None and (d.token_ids or (first and req.echo)):
            choice["logprobs"] = _completion_logprobs(
                req, [d], offset[0] + len(echo) * first, prompt_ids, first
            )
        offset[0] += len(text)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": [choice],
        }

    document_bodies(
        app,
        {
            ("POST", "/v1/chat/completions"): ChatCompletionRequest,
            ("POST", "/v1/completions"): CompletionRequest,
            ("POST", "/generate"): GenerateRequest,
            ("POST", "/telemetry/profile"): StepProfileRequest,
            ("POST", "/tokenize"): utility_routes.TokenizeRequest,
            ("POST", "/detokenize"): utility_routes.DetokenizeRequest,
        },
        frozenset(
            {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/generate")}
        ),
    )
    return app


class StepProfileRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    every: int = Field(strict=True, ge=0, le=INT32_MAX, description="every N-th step; 0: off")


def _scored_elsewhere(req) -> bool:
    """A PD decode request: prefill runs the prompt, so its logprobs come from there (the
    router merges them into decode's answer); decode neither asks for them nor shows them."""
    raw = (req.model_extra or {}).get("kvrelay_pd")
    return isinstance(raw, dict) and raw.get("role") == "decode"


def _batch_usage(groups: list[list[Generation]]) -> dict:
    """Usage of a batch of prompts: each prompt's (its n samples), summed."""
    parts = [_usage(g[0].prompt_ids, g) for g in groups]
    return fmt.usage(
        sum(u["prompt_tokens"] for u in parts),
        sum(u["completion_tokens"] for u in parts),
        sum(u["prompt_tokens_details"]["cached_tokens"] for u in parts),
    )


def _usage(prompt_ids: list[int], gens: list[Generation]) -> dict:
    """The prompt counted once, the n samples' completions summed (as OpenAI counts). Cached:
    the least any sample found, i.e. what the cache held before this request (the samples that
    waited for the one prefilling the prompt found it cached; it was computed once, here)."""
    return fmt.usage(
        len(prompt_ids),
        sum(g.completion_tokens for g in gens),
        min(g.cached_tokens for g in gens),
    )


async def _merged(gens: list[Generation]):
    """(index, delta) of several generations in arrival order; an error in any ends it (the
    others are cancelled, which aborts their engine requests)."""
    if len(gens) == 1:
        async for d in gens[0].deltas():
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for d in gen.deltas():
                await queue.put((i, d, None))
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put((i, None, e))
        await queue.put((i, None, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        running = len(gens)
        while running:
            i, d, err = await queue.get()
            if err is not None:
                raise err
            if d is None:
                running -= 1
            else:
                yield i, d
    finally:
        for t in tasks:
            t.cancel()


def _finish_reason(reason: str | None, parser: ChatOutputParser | None) -> str | None:
    """ "tool_calls" when the model ended its output with calls; "length" whenever max_tokens
    stopped it, calls or not (a call it was writing is cut off: content, not a call)."""
    if reason == "length":
        return reason
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
