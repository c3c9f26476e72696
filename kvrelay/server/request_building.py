"""From a validated request to engine requests: the checks every generating route makes (the
served model, n, readiness, stop tokens in the vocabulary), the context-length check, sampling
parameters (the request's, else the model's defaults), n samples as one group, and the router's
`kvrelay_pd` field (PD routing: its request id and this side's part)."""

from __future__ import annotations

import uuid

import msgspec

from kvrelay.engine.messages import PDParams, SamplingParams
from kvrelay.server import prompt_logprobs as plp
from kvrelay.server.errors import APIError, bad_request, unavailable
from kvrelay.server.generation import Generation
from kvrelay.server.generation_defaults import resolve as resolve_sampling
from kvrelay.server.schemas import ChatCompletionRequest, child_seed
from kvrelay.server.state import ServerState


def check_common(state: ServerState, req) -> None:
    """What chat and completions refuse before any work: another model, too many samples, n > 1
    through PD, prompt logprobs asked wrongly, an engine not ready."""
    if req.model != state.model_name:
        raise APIError(
            404,
            f"model {req.model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )
    if req.n > state.cfg.max_n:
        raise bad_request(f"n={req.n} is not supported (at most {state.cfg.max_n})", "n")
    if req.n > 1 and "kvrelay_pd" in (req.model_extra or {}):
        raise bad_request("a PD request carries one sample (the router splits n > 1)", "n")
    plp.check(req)
    check_ready(state, req)


def check_ready(state: ServerState, req) -> None:
    if not state.client.healthy:
        raise unavailable(state.client.dead_reason or "engine not ready")
    vocab = state.src.config.vocab_size
    for i, t in enumerate(req.stop_token_ids or ()):
        if t >= vocab:
            raise bad_request(
                f"stop_token_ids[{i}]: {t} is outside the vocabulary (size {vocab})",
                f"stop_token_ids[{i}]",
            )


def truncate(req, prompt_ids: list[int]) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last N tokens of the prompt."""
    n = req.truncate_prompt_tokens
    return prompt_ids if n is None or len(prompt_ids) <= n else prompt_ids[-n:]


def start(
    state: ServerState,
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
        prompt_logprobs=None if scored_elsewhere(req) else plp.wanted(req),
        min_tokens=getattr(req, "min_tokens", 0),
    )
    prefix = prefix or ("chatcmpl" if isinstance(req, ChatCompletionRequest) else "cmpl")
    rid = rid or f"{prefix}-{uuid.uuid4().hex}"
    pd, pd_rid = pd_params(req)
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
        state.cfg.request_timeout_s,
        pd=pd,
        min_tokens=getattr(req, "min_tokens", 0),
        include_stop=getattr(req, "include_stop_str_in_output", False),
    )


def start_n(
    state: ServerState, req, prompt_ids: list[int], grammar: str | None
) -> list[Generation]:
    """The request's n samples: engine requests <id>, <id>-1, ... (one response id), one
    group: the engine prefills the prompt once and the other samples share its KV."""
    first = start(state, req, prompt_ids, grammar=grammar)
    rest = [
        start(state, req, prompt_ids, grammar=grammar, index=i, rid=f"{first.rid}-{i}")
        for i in range(1, req.n)
    ]
    gens = [first, *rest]
    if len(gens) > 1:
        for g in gens:
            g.group = first.rid
    return gens


def scored_elsewhere(req) -> bool:
    """A PD decode request: prefill runs the prompt, so its logprobs come from there (the
    router merges them into decode's answer); decode neither asks for them nor shows them."""
    raw = (req.model_extra or {}).get("kvrelay_pd")
    return isinstance(raw, dict) and raw.get("role") == "decode"


def pd_params(req) -> tuple[PDParams | None, str | None]:
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
