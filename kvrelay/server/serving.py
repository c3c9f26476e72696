"""Running a request's generations, shared by the generating routes: to completion (aborted
when the client leaves), or as an SSE stream of chunks, then usage if asked, then [DONE] (an error
once streaming has begun is an error event, then [DONE]); usage as OpenAI counts it; vLLM's
prompt logprobs of a choice."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvrelay.server import openai_format as fmt
from kvrelay.server import prompt_logprobs as plp
from kvrelay.server.engine_client import EngineDead
from kvrelay.server.errors import APIError, internal, unavailable
from kvrelay.server.generation import Delta, Generation
from kvrelay.server.request_building import scored_elsewhere
from kvrelay.server.state import ServerState

log = logging.getLogger("kvrelay.api")


async def collect(request: Request, gens: list[Generation]) -> list[list[Delta]]:
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


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
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


def stream_error(state: ServerState, e: Exception, rid: str) -> str:
    """An exception in a stream that has begun: counted, logged, and sent as an SSE error
    event (the caller then ends the stream with [DONE], as OpenAI's clients expect)."""
    if isinstance(e, EngineDead):
        e = unavailable(str(e))
    elif not isinstance(e, APIError):
        log.exception("stream failed rid=%s", rid)
        e = internal(e)
    state.count_error(e.status)
    log.warning("stream error rid=%s status=%d message=%s", rid, e.status, e.message)
    return e.sse()


def stream(state: ServerState, gens, make_chunk, rid, created, obj, req, usage=None):
    """SSE chunks of every generation as they come (`make_chunk(index, delta, first)`),
    then usage if asked (`usage()`: the request's; default: one prompt's n samples), then
    [DONE]."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    usage = usage or (lambda: prompt_usage(gens[0].prompt_ids, gens))

    async def events():
        first = [True] * len(gens)
        try:
            async for i, d in merged(gens):
                chunk = make_chunk(i, d, first[i])
                if chunk is not None:  # None: nothing to say yet (a parser holds text)
                    yield f"data: {json.dumps(chunk)}\n\n"
                first[i] = False
        except Exception as e:
            yield stream_error(state, e, rid)
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


def prompt_usage(prompt_ids: list[int], gens: list[Generation]) -> dict:
    """The prompt counted once, the n samples' completions summed (as OpenAI counts). Cached:
    the least any sample found, i.e. what the cache held before this request (the samples that
    waited for the one prefilling the prompt found it cached; it was computed once, here)."""
    return fmt.usage(
        len(prompt_ids),
        sum(g.completion_tokens for g in gens),
        min(g.cached_tokens for g in gens),
    )


def batch_usage(groups: list[list[Generation]]) -> dict:
    """Usage of a batch of prompts: each prompt's (its n samples), summed."""
    parts = [prompt_usage(g[0].prompt_ids, g) for g in groups]
    return fmt.usage(
        sum(u["prompt_tokens"] for u in parts),
        sum(u["completion_tokens"] for u in parts),
        sum(u["prompt_tokens_details"]["cached_tokens"] for u in parts),
    )


async def vllm_prompt_logprobs(
    state: ServerState, req, prompt_ids: list[int], deltas
) -> list | None:
    """vLLM's prompt_logprobs of one choice; None from a PD decode server, which never
    runs the prompt: the router puts prefill's in (router/prompt_logprobs.py)."""
    if scored_elsewhere(req):
        return None
    return await asyncio.to_thread(plp.vllm, state.tokenizer, prompt_ids, plp.first(deltas))
