"""vLLM's utility routes: `POST /tokenize`, `POST /detokenize`, `GET /version`, `GET|POST /ping`.

- /tokenize takes `prompt` (with `add_special_tokens`, default true, as vLLM) or `messages` (the
  chat template, as `/v1/chat/completions` renders it: `add_generation_prompt` default true,
  `continue_final_message`, `tools`, `chat_template_kwargs`; `add_special_tokens` default false)
  and answers `tokens`, `count`, `max_model_len` and, with `return_token_strs`, `token_strs`.
- /detokenize takes `tokens` and answers `prompt`.
- /version answers `{"version": kvrelay's}`; /ping is liveness, like `/health`.
`model`, when given, must be the served one (404 otherwise, as the other routes)."""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvrelay.server.chat_format import UnsupportedField
from kvrelay.server.errors import APIError, bad_request, unavailable
from kvrelay.server.schemas import ChatCompletionRequest, ChatMessage, TokenId, Tool
from kvrelay.server.validation import parse_json, validate


def kvrelay_version() -> str:
    try:
        return version("kvrelay")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # prompt: true, messages: false (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model: str | None = None
    tokens: list[TokenId]


def liveness(state) -> PlainTextResponse:
    """ "ok" while the engine runs and its loop turns (a busy engine is alive); 503 naming why not."""
    reason = state.client.unhealthy_reason()
    if reason is not None:
        raise unavailable(reason)
    return PlainTextResponse("ok")


def register(app: FastAPI, state) -> None:
    """The routes, on `state` (state.ServerState: tokenizer, chat format, model name)."""

    def check_model(model: str | None) -> None:
        if model is not None and model != state.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {state.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if state.tokenizer is None or state.client.ready is None:
            raise unavailable("engine not ready")

    def chat_ids(req: TokenizeRequest) -> list[int]:
        body = {
            "model": state.model_name,
            "messages": [m.model_dump(exclude_none=True) for m in req.messages],
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
        }
        if req.continue_final_message and "add_generation_prompt" not in req.model_fields_set:
            body["add_generation_prompt"] = False  # vLLM: continuing the last message opens none
        if req.tools is not None:
            body["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        if req.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = req.chat_template_kwargs
        chat = validate(ChatCompletionRequest, body)
        try:
            ids = state.chat_format.prompt_ids(chat)
        except UnsupportedField as e:
            raise bad_request(str(e), e.param) from None
        except (ValueError, TypeError, TemplateError) as e:
            raise bad_request(f"the messages cannot be rendered: {e}", "messages") from None
        if req.add_special_tokens:
            special = state.tokenizer("", add_special_tokens=True).input_ids
            if special:  # where they would go around a rendered template is the model's own
                raise bad_request(
                    "add_special_tokens with messages is not supported for this tokenizer "
                    f"(it adds {special}); the chat template writes the special tokens",
                    "add_special_tokens",
                )
        return ids

    def tokenize_sync(req: TokenizeRequest) -> dict:
        if req.messages is not None:
            ids = chat_ids(req)
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = state.tokenizer.encode(req.prompt, add_special_tokens=add)
        strs = state.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": state.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = validate(TokenizeRequest, parse_json(await request.body()))
        check_model(req.model)
        return await asyncio.to_thread(tokenize_sync, req)  # a long prompt: off the loop

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = validate(DetokenizeRequest, parse_json(await request.body()))
        check_model(req.model)
        vocab = state.src.config.vocab_size
        for i, t in enumerate(req.tokens):
            if t >= vocab:
                raise bad_request(
                    f"tokens[{i}]: {t} is outside the vocabulary (size {vocab})", f"tokens[{i}]"
                )
        return {"prompt": await asyncio.to_thread(state.tokenizer.decode, req.tokens)}

    @app.get("/version")
    async def get_version():
        return {"version": kvrelay_version()}

    @app.api_route("/ping", methods=["GET", "POST"], response_class=PlainTextResponse)
    async def ping():
        """Liveness, as /health (vLLM's /ping, for SageMaker-style probes)."""
        return liveness(state)
