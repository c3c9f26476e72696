"""Prompt logprobs in the API: which requests ask for them, what is refused, and their two
response shapes.

- OpenAI legacy completions, `echo: true` with `logprobs: k`: the prompt's tokens lead
  `choices[0].logprobs` (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), the first
  one with null logprob and null alternatives (nothing precedes it), then the generated ones.
  This is what lm-eval's loglikelihood tasks read (`echo`, `max_tokens` 0 or 1, `logprobs` 1).
- vLLM's `prompt_logprobs: k` (completions and chat): a list with one entry per prompt token,
  the first null, each a dict token id -> {logprob, rank, decoded_token} holding the prompt
  token itself and the top k; per choice on completions, at the top level on chat (as vLLM).

Refused with a 400: `max_tokens` 0 without `echo`; `prompt_logprobs` with `stream` (vLLM refuses
it too). Through the PD router the prefill server scores the prompt (it runs it) and the router
merges its part into decode's answer (router/prompt_logprobs.py); `max_tokens` 0 goes to a
prefill server alone.
"""

from __future__ import annotations

import math

from kvrelay.engine.messages import PromptLogprob
from kvrelay.server.errors import bad_request
from kvrelay.server.schemas import CompletionRequest

FLOOR = -9999.0  # a logprob of -inf as vLLM sends it (JSON has no infinity)


def _echo(req) -> bool:
    return isinstance(req, CompletionRequest) and req.echo  # (chat: an unknown extra field)


def wanted(req) -> int | None:
    """Top alternatives per prompt token the request needs (None: no prompt logprobs)."""
    k = getattr(req, "prompt_logprobs", None)
    if _echo(req) and req.logprobs is not None:
        k = max(k or 0, req.logprobs)  # completions: logprobs is the number of alternatives
    return k


def check(req) -> None:
    """400s for what cannot be answered (one server and the PD router alike)."""
    if getattr(req, "max_tokens", None) == 0 and not _echo(req):
        raise bad_request("max_tokens must be at least 1 (0 only with echo)", "max_tokens")
    if getattr(req, "prompt_logprobs", None) is not None and req.stream:
        raise bad_request("prompt_logprobs is not available with stream=true", "prompt_logprobs")


def _finite(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def first(deltas) -> list[PromptLogprob] | None:
    """The engine sends a request's prompt logprobs once, with its first output."""
    return next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)


def _texts(tokenizer, prompt_ids: list[int], entries: list[PromptLogprob]) -> dict[int, str]:
    """Each token's text, decoded once per distinct id (in one batch: a long prompt has many)."""
    ids = set(prompt_ids) | {a.token_id for e in entries for a in e.top}
    order = sorted(ids)
    texts = tokenizer.batch_decode([[i] for i in order], skip_special_tokens=False)
    return dict(zip(order, texts, strict=True))


def legacy(
    tokenizer, prompt_ids: list[int], entries: list[PromptLogprob], k: int, as_ids: bool = False
) -> dict:
    """The prompt's part of a legacy completions `logprobs` object (offsets from 0 in the echo);
    `as_ids`: tokens shown as "token_id:<id>" (return_tokens_as_token_ids)."""
    text = _texts(tokenizer, prompt_ids, entries)
    shown = (lambda t: f"token_id:{t}") if as_ids else text.__getitem__
    tokens = [shown(t) for t in prompt_ids]
    offsets, pos = [], 0
    for t in prompt_ids:
        offsets.append(pos)
        pos += len(text[t])
    lps: list[float | None] = [None] + [_finite(e.logprob) for e in entries]
    tops: list[dict | None] = [None] + [
        {shown(a.token_id): _finite(a.logprob) for a in e.top[:k]} for e in entries
    ]
    if len(lps) != len(tokens):
        raise ValueError(f"{len(entries)} prompt logprobs for a prompt of {len(tokens)} tokens")
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def vllm(tokenizer, prompt_ids: list[int], entries: list[PromptLogprob]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: [null, {token_id: {logprob, rank, decoded_token}}, ...]."""
    text = _texts(tokenizer, prompt_ids, entries)
    out: list[dict | None] = [None]
    for tok, e in zip(prompt_ids[1:], entries, strict=True):
        d = {str(tok): {"logprob": _finite(e.logprob), "rank": e.rank, "decoded_token": text[tok]}}
        for rank, a in enumerate(e.top, 1):
            d.setdefault(
                str(a.token_id),
                {"logprob": _finite(a.logprob), "rank": rank, "decoded_token": text[a.token_id]},
            )
        out.append(d)
    return out


def merge(prompt: dict, generated: dict | None) -> dict:
    """Prompt entries, then the generated tokens' (legacy completions logprobs)."""
    if generated is None:
        return prompt
    return {key: prompt[key] + generated[key] for key in prompt}
