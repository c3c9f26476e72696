"""`POST /generate`, SGLang's native API: one prompt or a batch, through the same request
building as the OpenAI routes (its body seen as sglang_api.SamplingView); the body and answer
shapes are sglang_api.py's."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvrelay.server import request_building as rb
from kvrelay.server import serving, structured
from kvrelay.server import sglang_api as sglang
from kvrelay.server.errors import bad_request
from kvrelay.server.request_body import body_data
from kvrelay.server.sglang_api import GenerateRequest
from kvrelay.server.state import ServerState
from kvrelay.server.validation import validate


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/generate")
    async def generate(request: Request):
        """SGLang's native generate (sglang_api.py): one prompt or a batch."""
        data = await body_data(request, state.pd_secret)
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
            rb.check_ready(state, view)
            try:
                shaper = sglang.logprobs_of(req, state.tokenizer, prompt_ids)
            except ValueError as e:
                raise bad_request(str(e), "logprob_start_len") from None
            gen = rb.start(state, view, prompt_ids, "generate", grammar=grammar)
            rid = req.rid if req.rid and not req.is_batch else gen.rid  # a batch: one id each
            items.append(sglang.Item(gen, rid, shaper))
        gens = [it.gen for it in items]
        if req.stream:
            return StreamingResponse(
                sglang.events(
                    items,
                    req.is_batch,
                    serving.merged(gens),
                    lambda e, rid: serving.stream_error(state, e, rid),
                ),
                media_type="text/event-stream",
            )
        start = gens[0].created
        outputs = await serving.collect(request, gens)
        answers = [sglang.answer(it, out, start) for it, out in zip(items, outputs, strict=True)]
        return answers if req.is_batch else answers[0]
