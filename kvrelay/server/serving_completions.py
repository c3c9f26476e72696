"""`POST /v1/completions`: one prompt or a batch (text or token ids), n samples each, echo,
legacy logprobs (with the prompt's under echo) and vLLM's prompt_logprobs per choice, whole or
streamed as `text_completion` events. Choice index = prompt_i * n + sample_j."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from kvrelay.server import openai_format as fmt
from kvrelay.server import prompt_logprobs as plp
from kvrelay.server import request_building as rb
from kvrelay.server import serving, structured
from kvrelay.server.errors import bad_request
from kvrelay.server.generation import Delta
from kvrelay.server.request_body import parse
from kvrelay.server.schemas import CompletionRequest
from kvrelay.server.state import ServerState


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest, state.pd_secret)
        rb.check_common(state, req)
        if len(req.prompts) > 1 and "kvrelay_pd" in (req.model_extra or {}):
            raise bad_request(
                "a PD request carries one prompt (the router splits batches)", "prompt"
            )
        grammar = await asyncio.to_thread(structured.completion_grammar, req)
        prompts = [await _prompt(state, req, p) for p in req.prompts]  # (echo, ids) each
        groups = [rb.start_n(state, req, ids, grammar) for _, ids in prompts]
        # Flat, in choice order: index = prompt_i * n + sample_j.
        items = [(g, *prompts[i]) for i, group in enumerate(groups) for g in group]
        gens = [g for g, _, _ in items]
        rid, created = gens[0].rid, int(gens[0].created)
        if req.stream:
            offsets = [[0] for _ in gens]  # each choice's text offset of its next token
            return serving.stream(
                state,
                gens,
                lambda i, d, first: _chunk(
                    state, rid, created, i, d, first, req, items[i][1], offsets[i], items[i][2]
                ),
                rid,
                created,
                "text_completion",
                req,
                usage=lambda: serving.batch_usage(groups),
            )
        choices = []
        for i, deltas in enumerate(await serving.collect(request, gens)):
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
                    _logprobs, state, req, deltas, len(echo), prompt_ids, True
                )
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = await serving.vllm_prompt_logprobs(
                    state, req, prompt_ids, deltas
                )
            choices.append(choice)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
            "usage": serving.batch_usage(groups),
        }


async def _prompt(state: ServerState, req, prompt) -> tuple[str, list[int]]:
    """One prompt of a completions request: (its echo text, its token ids)."""
    ids = (
        list(prompt)
        if isinstance(prompt, list)
        else await asyncio.to_thread(state.tokenizer.encode, prompt, add_special_tokens=False)
    )
    if not ids:
        raise bad_request("prompt is empty", "prompt")
    truncated = rb.truncate(req, ids)
    if len(truncated) < len(ids):
        prompt, ids = truncated, truncated  # echo shows what the model read
    if not req.echo:
        return "", ids
    return (prompt if isinstance(prompt, str) else state.tokenizer.decode(ids)), ids


def _logprobs(
    state: ServerState, req, deltas: list[Delta], offset: int, prompt_ids: list[int], first: bool
) -> dict:
    """Legacy `logprobs` of these deltas' tokens (from text offset `offset`), led by the
    prompt's with echo (in the first chunk of a stream)."""
    as_ids = req.return_tokens_as_token_ids
    out = fmt.completion_logprobs(state.tokenizer, deltas, offset, as_ids)
    if req.echo and first and not rb.scored_elsewhere(req):
        entries = plp.first(deltas)
        prompt = plp.legacy(state.tokenizer, prompt_ids, entries, req.logprobs, as_ids)
        out = plp.merge(prompt, out)
    return out


def _chunk(
    state: ServerState,
    rid,
    created,
    index,
    d: Delta,
    first: bool,
    req,
    echo: str,
    offset: list[int],
    prompt_ids,
) -> dict:
    """One streamed `text_completion` chunk; `offset` (one cell) advances past its text."""
    text = (echo if first else "") + d.text
    choice = {"index": index, "text": text, "finish_reason": d.finish_reason, "logprobs": None}
    if req.logprobs is not None and (d.token_ids or (first and req.echo)):
        choice["logprobs"] = _logprobs(
            state, req, [d], offset[0] + len(echo) * first, prompt_ids, first
        )
    offset[0] += len(text)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": state.model_name,
        "choices": [choice],
    }
