"""SGLang's native `POST /generate`: its request body, and its answers, so that SGLang-native
clients work against kvrelay.

The request: `text` or `input_ids` (a batch of one is accepted, larger batches are refused),
`sampling_params` with SGLang's names (max_new_tokens, temperature, top_p, top_k, min_p, stop,
stop_token_ids, ignore_eos, penalties, sampling_seed; structured output: one of json_schema,
regex, ebnf, as llguidance grammars, structured.py), `stream`, `rid`. The answer: `text`,
`output_ids` and `meta_info` {id, finish_reason ({"type": "length", "length": n} or
{"type": "stop", "matched": token id or string}), prompt_tokens, completion_tokens,
e2e_latency}; streamed as SSE `data:` events whose `text` is the whole output so far, then
`data: [DONE]`. Anything SGLang would honour but kvrelay cannot (logprobs, structural tags,
images, LoRA, n > 1, repetition penalty, keeping special tokens) is a 400, never ignored."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvrelay.server.generation import Delta, Generation
from kvrelay.server.schemas import Int64, Positive, TokenId, stop_list

SGLANG_MAX_NEW_TOKENS = 128  # SGLang's default


class SGLangSamplingParams(BaseModel):
    # Unknown names are refused: each of SGLang's other parameters changes the output.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    max_new_tokens: Positive | None = SGLANG_MAX_NEW_TOKENS
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=256)
    ignore_eos: bool = False
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    sampling_seed: Int64 | None = None
    json_schema: str | None = None  # a JSON schema, as JSON text
    regex: str | None = None
    ebnf: str | None = None  # GBNF (llama.cpp's) or Lark
    # Accepted only with the value that changes nothing.
    n: Literal[1] = 1
    repetition_penalty: float = Field(default=1.0, ge=1.0, le=1.0)
    skip_special_tokens: Literal[True] = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: Literal[False] = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return stop_list(v)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    stream: bool = False
    rid: str | None = Field(default=None, max_length=256)
    return_logprob: Literal[False] = False
    logprob_start_len: int | None = None  # only read with return_logprob
    top_logprobs_num: int | None = None  # only read with return_logprob

    @field_validator("text", "input_ids")
    @classmethod
    def _one(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError("batched requests are not supported; send one per request")
            v = v[0]
        if v is not None and len(v) == 0:
            raise ValueError("is empty")
        return v

    @model_validator(mode="after")
    def _text_or_ids(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        return self


@dataclass
class SamplingView:
    """A /generate request seen through the fields the OpenAI routes' generation reads."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    stop_token_ids: list[int] | None
    ignore_eos: bool
    stop_strings: list[str]
    num_logprobs: None = None
    model_extra: dict = field(default_factory=dict)

    @classmethod
    def of(cls, req: GenerateRequest, pd: dict | None = None) -> SamplingView:
        """`pd`: the router's (signed) `kvrelay_pd` field, when the request comes through PD."""
        p = req.sampling_params
        return cls(
            p.max_new_tokens,
            p.temperature,
            p.top_p,
            p.top_k,
            p.min_p,
            p.sampling_seed,
            p.presence_penalty,
            p.frequency_penalty,
            p.stop_token_ids,
            p.ignore_eos,
            list(p.stop or []),
            model_extra={} if pd is None else {"kvrelay_pd": pd},
        )


def finish_reason(gen: Generation, deltas: list[Delta]) -> dict | None:
    last = deltas[-1] if deltas else None
    if last is None or last.finish_reason is None:
        return None
    if last.finish_reason == "length":
        return {"type": "length", "length": gen.completion_tokens}
    if gen.matched_stop is not None:
        return {"type": "stop", "matched": gen.matched_stop}
    ids = [t for d in deltas for t in d.token_ids]
    return {"type": "stop", "matched": ids[-1] if ids else None}


def answer(gen: Generation, deltas: list[Delta], rid: str, start: float) -> dict:
    """The body SGLang answers: the output so far and its meta_info."""
    return {
        "text": "".join(d.text for d in deltas),
        "output_ids": [t for d in deltas for t in d.token_ids],
        "meta_info": {
            "id": rid,
            "finish_reason": finish_reason(gen, deltas),
            "prompt_tokens": len(gen.prompt_ids),
            "completion_tokens": gen.completion_tokens,
            "cached_tokens": gen.cached_tokens,
            "e2e_latency": time.time() - start,
        },
    }


async def events(
    gen: Generation, rid: str, on_error: Callable[[Exception, str], str]
) -> AsyncIterator[str]:
    """SSE events, each with the whole output so far (SGLang's default streaming), then [DONE];
    a failure is an error event, then [DONE]."""
    start = time.time()
    deltas: list[Delta] = []
    try:
        async for d in gen.deltas():
            deltas.append(d)
            if d.text or d.finish_reason:
                yield f"data: {json.dumps(answer(gen, deltas, rid, start))}\n\n"
    except Exception as e:
        yield on_error(e, gen.rid)
    yield "data: [DONE]\n\n"
