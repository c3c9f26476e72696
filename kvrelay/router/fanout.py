"""Batched prompts and n > 1 through the PD router: one PD request per (prompt, sample), merged
into the answer one server gives.

A request with P prompts (completions' list of prompts, SGLang's list of texts or input_ids) and
n samples becomes P x n requests of one prompt and n=1, sent at once; sample j is seeded
`child_seed(seed, j)`, the seed one server gives its sample j (schemas.child_seed), so seeded
sampling is the same. The answers are merged in order: choice index = prompt_i * n + sample_j;
usage sums each prompt's (its prompt once, its samples' completions, the least cached count of
its samples); SGLang's batch answers a list. Streamed, the sub-streams are interleaved as they
come, each chunk's choice index (SGLang: `index`) rewritten and every chunk given one id; their
usage chunks are summed into one before `[DONE]`. A sub-request that fails before streaming
fails the request (the others are closed, which aborts them); one that fails while streaming ends
the stream with its error event, then `[DONE]`, as one server's stream does."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi.responses import Response, StreamingResponse

from kvrelay.server.schemas import child_seed
from kvrelay.server.sglang_api import GenerateRequest


def split(path: str, body: dict, req) -> list[dict] | None:
    """The sub-request bodies in index order, or None when the request is one PD request."""
    if isinstance(req, GenerateRequest):
        if not req.is_batch:
            return None
        # One server gives a batch's answers ids of their own: `rid` names a single prompt's.
        rest = {k: v for k, v in body.items() if k != "rid"}
        return [{**rest, req.prompt_field: p} for p in req.prompts]
    prompts = getattr(req, "prompts", [None])  # chat: the one conversation
    raw = body.get("prompt")
    batch = isinstance(raw, list) and isinstance(raw[0], str | list)
    if req.n == 1 and not batch:
        return None
    subs = []
    for p in prompts:
        for j in range(req.n):
            sub = {**body, "n": 1}
            if p is not None:
                sub["prompt"] = p
            if req.seed is not None:
                sub["seed"] = child_seed(req.seed, j)
            subs.append(sub)
    return subs


def _usage(bodies: list[dict], n: int) -> dict:
    prompt = completion = cached = 0
    for i in range(0, len(bodies), n):
        group = [b["usage"] for b in bodies[i : i + n]]
        prompt += group[0]["prompt_tokens"]
        completion += sum(u["completion_tokens"] for u in group)
        cached += min((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in group)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def merge_bodies(path: str, bodies: list[dict], n: int) -> dict | list:
    if path == "/generate":
        return bodies
    out = dict(bodies[0])
    out["choices"] = []
    for k, b in enumerate(bodies):
        choice = dict(b["choices"][0])
        choice["index"] = k
        out["choices"].append(choice)
    out["usage"] = _usage(bodies, n)
    return out


async def run(
    path: str,
    body: dict,
    subs: list[dict],
    n: int,
    route: Callable[[dict], Awaitable[Response]],
) -> Response:
    """Route every sub-request at once and merge their answers."""
    resps = await asyncio.gather(*(route(s) for s in subs), return_exceptions=True)
    failed = next((r for r in resps if isinstance(r, BaseException)), None)
    bad = next(
        (r for r in resps if not isinstance(r, BaseException) and r.status_code != 200), None
    )
    if failed is not None or bad is not None:
        await _close_all(resps)
        if failed is not None:
            raise failed
        return bad
    if not body.get("stream"):
        bodies = [json.loads(r.body) for r in resps]
        return Response(json.dumps(merge_bodies(path, bodies, n)), media_type="application/json")
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(
        _merged_events(path, resps, n, include_usage), media_type="text/event-stream"
    )


async def _close_all(resps) -> None:
    for r in resps:
        if isinstance(r, StreamingResponse):
            await r.body_iterator.aclose()
            if r.background is not None:
                await r.background()


async def _merged_events(
    path: str, resps: list[StreamingResponse], n: int, include_usage: bool
) -> AsyncIterator[str]:
    rid = f"{'chatcmpl' if 'chat' in path else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, r: StreamingResponse) -> None:
        try:
            async for chunk in r.body_iterator:
                text = chunk if isinstance(chunk, str) else chunk.decode()
                for line in text.split("\n"):
                    if line.strip():
                        await queue.put((k, line))
        finally:
            await queue.put((k, None))

    tasks = [asyncio.create_task(pump(k, r)) for k, r in enumerate(resps)]
    usages: list[dict | None] = [None] * len(resps)
    obj = "chat.completion.chunk" if "chat" in path else "text_completion"
    model = None
    try:
        running = len(resps)
        while running:
            k, line = await queue.get()
            if line is None:
                running -= 1
                continue
            if not line.startswith("data: "):
                yield line + "\n\n"  # an SSE comment
                continue
            data = line[6:]
            if data.strip() == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:  # a sub-stream failed: the request's stream ends with it
                yield line + "\n\n"
                yield "data: [DONE]\n\n"
                return
            if path == "/generate":
                yield "data: " + json.dumps({**event, "index": k}) + "\n\n"
                continue
            model = event.get("model", model)
            if not event.get("choices") and event.get("usage") is not None:
                usages[k] = event  # summed below, once every sub-stream is done
                continue
            for c in event.get("choices", []):
                c["index"] = k
            event["id"], event["created"] = rid, created
            yield "data: " + json.dumps(event) + "\n\n"
        if include_usage and all(u is not None for u in usages):
            usage = _usage(usages, n)
            chunk = {"id": rid, "object": obj, "created": created, "model": model}
            yield "data: " + json.dumps({**chunk, "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # before closing what they read
        await _close_all(resps)
