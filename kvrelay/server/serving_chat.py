"""`POST /v1/chat/completions`: the messages rendered by the model's chat format, n samples,
the output parsed into content, reasoning and tool calls (chat_output.py), whole or streamed as
`chat.completion.chunk` events; logprobs, and vLLM's prompt_logprobs beside the choices."""

from __future__ import annotations

import asyncio
import logging
import uuid

from fastapi import FastAPI, Request
from jinja2 import TemplateError

from kvrelay.server import openai_format as fmt
from kvrelay.server import request_building as rb
from kvrelay.server import serving, structured
from kvrelay.server.chat_format import UnsupportedField
from kvrelay.server.chat_output import ChatOutputParser, delta_dict, message_dict
from kvrelay.server.errors import bad_request
from kvrelay.server.generation import Delta
from kvrelay.server.request_body import parse
from kvrelay.server.schemas import ChatCompletionRequest
from kvrelay.server.state import ServerState

log = logging.getLogger("kvrelay.api")


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatCompletionRequest, state.pd_secret)
        rb.check_common(state, req)
        chat_format = state.chat_format
        try:  # off the event loop: a long prompt must not stall other requests' streams
            prompt_ids = await asyncio.to_thread(chat_format.prompt_ids, req)
        except UnsupportedField as e:
            raise bad_request(str(e), e.param) from None
        except (ValueError, TypeError, TemplateError) as e:  # what the messages made it raise
            raise bad_request(f"the messages cannot be rendered: {e}", "messages") from None
        prompt_ids = rb.truncate(req, prompt_ids)
        grammar = await asyncio.to_thread(structured.chat_grammar, req, chat_format)
        gens = rb.start_n(state, req, prompt_ids, grammar)
        rid, created = gens[0].rid, int(gens[0].created)
        parsers = [chat_format.output_parser(req, f"call_{uuid.uuid4().hex[:16]}_") for _ in gens]
        if req.stream:
            return serving.stream(
                state,
                gens,
                lambda i, d, first: _chunk(state, rid, created, i, d, first, req, parsers[i]),
                rid,
                created,
                "chat.completion.chunk",
                req,
            )
        choices = []
        outputs = await serving.collect(request, gens)
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
            "usage": serving.prompt_usage(prompt_ids, gens),
        }
        if req.prompt_logprobs is not None:  # vLLM puts them beside the choices on chat
            body["prompt_logprobs"] = await serving.vllm_prompt_logprobs(
                state, req, prompt_ids, outputs[0]
            )
        return body


def _chunk(
    state: ServerState,
    rid,
    created,
    index: int,
    d: Delta,
    first: bool,
    req,
    parser: ChatOutputParser | None,
) -> dict | None:
    """One `chat.completion.chunk`; None while the parser holds back what it has seen."""
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
        choice["logprobs"] = fmt.chat_logprobs(state.tokenizer, [d], req.return_tokens_as_token_ids)
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": state.model_name,
        "choices": [choice],
    }


def _finish_reason(reason: str | None, parser: ChatOutputParser | None) -> str | None:
    """ "tool_calls" when the model ended its output with calls; "length" whenever max_tokens
    stopped it, calls or not (a call it was writing is cut off: content, not a call)."""
    if reason == "length":
        return reason
    return "tool_calls" if reason and parser is not None and parser.tool_calls else reason


def _log_parse_errors(rid: str, parser: ChatOutputParser) -> None:
    if parser.errors:
        log.warning("tool call parse errors rid=%s errors=%s", rid, "; ".join(parser.errors))
