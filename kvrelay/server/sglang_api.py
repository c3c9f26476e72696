"""SGLang's native `POST /generate`: its request body, and its answers, so that SGLang-native
clients (its bench_serving among them) work against kvrelay.

The request: `text` or `input_ids`, one prompt or a batch (a list of texts or of id lists:
the answer is then a list, in order; streamed, each event carries its prompt's `index`),
`sampling_params` with SGLang's names (max_new_tokens, temperature, top_p, top_k, min_p, stop,
stop_token_ids, ignore_eos, penalties, sampling_seed; structured output: one of json_schema,
regex, ebnf, as llguidance grammars, structured.py), `stream`, `rid`, and logprobs:
`return_logprob` with `logprob_start_len`, `top_logprobs_num`, `return_text_in_logprobs`
(sglang_logprobs.py). The answer: `text`, `output_ids` and `meta_info` {id, finish_reason
({"type": "length", "length": n} or {"type": "stop", "matched": token id or string}),
prompt_tokens, completion_tokens, cached_tokens, e2e_latency, and the logprobs asked for};
streamed as SSE `data:` events whose `text` is the whole output so far, then `data: [DONE]`.
Fields SGLang clients send with a neutral value are accepted (`lora_path: null`,
`return_routed_experts: false`, `return_hidden_states: false`, `token_ids_logprob: null`,
`image_data: null`); anything SGLang would honour but kvrelay cannot (any other value of those,
structural tags, n > 1, repetition penalty, keeping special tokens) is a 400 naming the field,
never ignored."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvrelay.server.generation import Delta, Generation
from kvrelay.server.schemas import (
    Int64,
    Positive,
    TokenId,
    check_prompts,
    stop_list,
)
from kvrelay.server.sglang_logprobs import SGLangLogprobs

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
    return_logprob: bool = False
    # First prompt position whose logprob is returned; -1 (SGLang's default): none.
    logprob_start_len: int = Field(default=-1, ge=-1, le=2**31 - 1)
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    # SGLang's, accepted only with the value that changes nothing.
    token_ids_logprob: None = Field(default=None, description="not supported")
    lora_path: None = Field(default=None, description="not supported (no LoRA adapters)")
    return_routed_experts: Literal[False] = False
    return_hidden_states: Literal[False] = False
    image_data: None = Field(default=None, description="not supported (text models)")

    @field_validator("text", "input_ids")
    @classmethod
    def _prompts(cls, v):
        return check_prompts(v, "is empty")

    @model_validator(mode="after")
    def _text_or_ids(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        return self

    @property
    def is_batch(self) -> bool:
        v = self.text if self.text is not None else self.input_ids
        return isinstance(v, list) and isinstance(v[0], str | list)

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt (text or token ids); a single prompt is a batch of one."""
        v = self.text if self.text is not None else self.input_ids
        return list(v) if self.is_batch else [v]

    @property
    def prompt_field(self) -> str:
        return "text" if self.text is not None else "input_ids"


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
    num_logprobs: int | None = None  # output logprobs: the top alternatives per token
    prompt_logprobs: int | None = None  # prompt logprobs (logprob_start_len within the prompt)
    model_extra: dict = field(default_factory=dict)

    @classmethod
    def of(cls, req: GenerateRequest, pd: dict | None = None, prompt_len: int = 0) -> SamplingView:
        """`pd`: the router's (signed) `kvrelay_pd` field, when the request comes through PD;
        `prompt_len`: this prompt's tokens (whether logprob_start_len reaches into it)."""
        p = req.sampling_params
        k = req.top_logprobs_num if req.return_logprob else None
        start = req.logprob_start_len
        scored = k is not None and 0 <= start < prompt_len
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
            num_logprobs=k,
            prompt_logprobs=k if scored else None,
            model_extra={} if pd is None else {"kvrelay_pd": pd},
        )


def logprobs_of(req: GenerateRequest, tokenizer, prompt_ids: list[int]) -> SGLangLogprobs | None:
    """The request's logprob shaper, or None without return_logprob; a logprob_start_len past
    the prompt is a ValueError (SGLang refuses it too)."""
    if not req.return_logprob:
        return None
    start = req.logprob_start_len
    if start > len(prompt_ids):
        raise ValueError(f"logprob_start_len {start} is past the prompt ({len(prompt_ids)} tokens)")
    start = len(prompt_ids) if start < 0 else start
    return SGLangLogprobs(
        tokenizer, prompt_ids, start, req.top_logprobs_num, req.return_text_in_logprobs
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


@dataclass
class Item:
    """One prompt of a /generate request: its generation, answer id and logprob shaper."""

    gen: Generation
    rid: str
    logprobs: SGLangLogprobs | None = None


def answer(item: Item, deltas: list[Delta], start: float, index: int | None = None) -> dict:
    """The body SGLang answers: the output so far and its meta_info (`index`: the prompt's
    place in a streamed batch)."""
    gen = item.gen
    meta = {
        "id": item.rid,
        "finish_reason": finish_reason(gen, deltas),
        "prompt_tokens": len(gen.prompt_ids),
        "completion_tokens": gen.completion_tokens,
        "cached_tokens": gen.cached_tokens,
        "e2e_latency": time.time() - start,
    }
    if item.logprobs is not None:
        meta |= item.logprobs.meta(deltas)
    out = {
        "text": "".join(d.text for d in deltas),
        "output_ids": [t for d in deltas for t in d.token_ids],
        "meta_info": meta,
    }
    return out if index is None else {**out, "index": index}


async def events(
    items: list[Item], batch: bool, merged, on_error: Callable[[Exception, str], str]
) -> AsyncIterator[str]:
    """SSE events, each with one prompt's whole output so far (SGLang's default streaming; a
    batch's events carry `index`), then [DONE]; a failure is an error event, then [DONE].
    `merged`: the generations' (index, delta) pairs in arrival order."""
    start = time.time()
    deltas: list[list[Delta]] = [[] for _ in items]
    try:
        async for i, d in merged:
            deltas[i].append(d)
            if d.text or d.finish_reason:
                body = answer(items[i], deltas[i], start, i if batch else None)
                yield f"data: {json.dumps(body)}\n\n"
    except Exception as e:
        yield on_error(e, items[0].gen.rid)
    yield "data: [DONE]\n\n"
