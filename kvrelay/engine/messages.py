"""Typed messages between the API process and the engine process (msgspec over ZeroMQ)."""

from __future__ import annotations

from typing import Annotated

import msgspec

_Id = Annotated[str, msgspec.Meta(max_length=256)]  # as disagg/protocol.py's Id


class PDParams(msgspec.Struct, frozen=True):
    """What the router tells each side about one request (the API process passes it on in
    AddRequest; the engine's transfer agents act on it)."""

    role: Annotated[str, msgspec.Meta(max_length=16)]  # prefill | decode
    transfer_id: _Id
    decode_addr: _Id = ""  # prefill only: the decode engine's transfer listener, host:port
    decode_instance: _Id = ""  # prefill only: the decode instance the router saw (restarts)


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 16  # 0: the request ends after its prefill (with prompt logprobs: scoring)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: chosen token plus n top alternatives
    # llguidance grammar (its serialized text) the output must match; None: unconstrained.
    grammar: str | None = None
    # None: none; n >= 0: each prompt token's logprob (from the prefill) plus n top alternatives.
    prompt_logprobs: int | None = None
    # EOS and stop_token_ids are masked until the output has this many tokens (vLLM's).
    min_tokens: int = 0


class AddRequest(msgspec.Struct, tag=True):
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    pd: PDParams | None = None  # set by the router in PD mode
    # The n samples of one request share a group (the first sample's rid): they share its
    # prompt's KV through the prefix cache (engine/siblings.py). None: a request of its own.
    group: str | None = None


class AbortRequest(msgspec.Struct, tag=True):
    rid: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class SetStepProfile(msgspec.Struct, tag=True):
    every: int  # profile every N-th step that runs a batch; 0: off


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class PromptLogprob(msgspec.Struct, array_like=True):
    """A prompt token's logprob given the tokens before it, its rank (1: the most likely; ties
    count, as in vLLM) and the top alternatives."""

    logprob: float
    rank: int
    top: list[TokenLogprob]


class RequestOutput(msgspec.Struct, array_like=True):
    rid: str
    token_ids: list[int]
    # One entry per token: the chosen token's logprob, then the top alternatives.
    logprobs: list[float] | None = None
    top_logprobs: list[list[TokenLogprob]] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    num_prompt_tokens: int = 0
    cause: str | None = None  # PD failures: the cause (kvrelay.disagg.protocol.Cause)
    # Prompt tokens 1..n-1 (token 0 has nothing before it), on a request's first output only.
    prompt_logprobs: list[PromptLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class EngineStats(msgspec.Struct):
    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    num_preemptions: int
    step_ms: float
    batch_size: int
    num_tokens: int
    num_prefill: int = 0  # sequences of the step that were prefill chunks (the rest decoded)
    prefill_cap: int = 0  # prefill tokens the step was allowed (--max-decode-slowdown; 0: off)
    failed_steps: int = 0  # batch steps in a row whose forward raised (0 after a good step)
    # A profiled step: ms per component (attention, mlp | moe, communication, other).
    components: dict[str, float] | None = None
    pd_transfers: dict[str, int] | None = None  # PD roles: transfers per state (the agent's)
    pd_failures: dict[str, int] | None = None  # PD roles: failed transfers by cause, since start
    # PD roles: KV bytes since start, direction ("sent" | "installed") -> backend -> bytes
    pd_bytes: dict[str, dict[str, int]] | None = None
    pd_bootstrap: dict[str, int] | None = None  # PD roles: bootstrap events since start
    # PD roles: (side, phase, seconds) of the transfers finished since the previous stats
    pd_timings: list[tuple[str, str, float]] | None = None
    # Prefix cache totals since start (None: no prefix cache): query_tokens, hit_tokens,
    # evicted_pages; and cached_pages, the pages it holds now. With a host tier also
    # host_offloaded_pages, host_loaded_pages, host_evicted_pages totals and host_pages now.
    prefix_cache: dict[str, int] | None = None
    # Speculative decoding totals since start (None: off): num_drafts (requests' verify steps),
    # num_draft_tokens, num_accepted_tokens, accepted_pos_I (the draft at position I accepted).
    spec_decode: dict[str, int] | None = None


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]
    stats: EngineStats | None = None


class EngineReady(msgspec.Struct, tag=True):
    max_model_len: int
    max_total_tokens: int
    page_size: int
    device: str
    dtype: str
    role: str = "single"
    instance_id: str = ""
    transfer_addr: str = ""  # decode role: where prefill engines send KV
    transfer_layout: str = ""  # PD roles: the cache layout fingerprint peers must share


class EngineFailed(msgspec.Struct, tag=True):
    message: str


ToEngine = AddRequest | AbortRequest | Shutdown | SetStepProfile
FromEngine = StepOutputs | EngineReady | EngineFailed
