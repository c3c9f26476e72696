"""One request's life in the API process: engine tokens in, text deltas out, stop strings applied.

Stop strings as vLLM applies them: one counts only where it ends in text of an output token past
`min_tokens` (the engine masks EOS and stop tokens until then); the output is cut before it, or
after it with include_stop_str_in_output."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvrelay.disagg.protocol import pd_status
from kvrelay.engine.messages import (
    PDParams,
    PromptLogprob,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from kvrelay.server.engine_client import EngineClient
from kvrelay.server.errors import APIError
from kvrelay.server.tokenizer import IncrementalDetokenizer


@dataclass
class Delta:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[PromptLogprob] | None = None  # on the first delta, when asked for


@dataclass
class Generation:
    """Runs one request; iterate `deltas()`; usage figures are filled as it goes."""

    client: EngineClient
    tokenizer: object
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stops: list[str]
    metrics: object
    timeout_s: float
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    finished: bool = False
    created: float = field(default_factory=time.time)
    pd: PDParams | None = None  # PD mode: this side's part of a disaggregated request
    matched_stop: str | None = None  # the stop string that ended the output, if one did
    group: str | None = None  # n samples: the group sharing the prompt's KV (AddRequest.group)
    min_tokens: int = 0  # no stop string ends the output before this many tokens
    include_stop: bool = False  # the matched stop string stays in the output

    async def deltas(self) -> AsyncIterator[Delta]:
        q = await self.client.submit(self.rid, self.prompt_ids, self.params, self.pd, self.group)
        detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        hold = (
            max((len(s) for s in self.stops), default=1) - 1
        )  # chars that may start a stop string
        pending = ""  # decoded text not yet released (it may begin a stop string)
        floor = 0  # a stop string must end past this index of `pending` (min_tokens)
        start = time.perf_counter()
        first_at = None
        try:
            while True:
                try:
                    out: RequestOutput = await asyncio.wait_for(q.get(), self.timeout_s)
                except TimeoutError:
                    raise APIError(
                        504, f"request timed out after {self.timeout_s:.0f}s", "timeout"
                    ) from None
                if out.error:
                    if out.finish_reason == "rejected":
                        raise APIError(400, out.error)
                    if out.cause:  # counted by the engine's transfer agent (see Metrics)
                        raise APIError(
                            pd_status(out.cause), out.error, "server_error", code=out.cause
                        )
                    status = 503 if self.client.dead_reason else 500
                    raise APIError(status, out.error, "server_error")
                if out.finish_reason == "abort":
                    raise APIError(499, "request aborted")
                if out.token_ids and first_at is None:
                    first_at = time.perf_counter()
                    self.metrics.ttft.observe(first_at - start)
                self.completion_tokens += len(out.token_ids)
                self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)
                new = detok.add(out.token_ids)
                if out.finish_reason:
                    new += detok.flush()
                pending += new
                reason = out.finish_reason
                if self.completion_tokens <= self.min_tokens:
                    floor = len(pending)  # this text is the first min_tokens tokens'
                hit = _find_stop(pending, self.stops, floor)
                if hit is not None:
                    cut, self.matched_stop = hit
                    if self.include_stop:
                        cut += len(self.matched_stop)
                    pending, reason = pending[:cut], "stop"
                done = reason is not None
                release = pending if done else pending[: max(len(pending) - hold, 0)]
                pending = pending[len(release) :]
                floor = max(floor - len(release), 0)
                yield Delta(
                    release,
                    out.token_ids,
                    out.logprobs or [],
                    out.top_logprobs or [],
                    reason,
                    out.prompt_logprobs,
                )
                if done:
                    self.finished = True
                    if out.finish_reason is None:  # we stopped it on a stop string
                        await self.client.abort(self.rid)
                    self._observe(start, first_at, reason)
                    return
        finally:
            if not self.finished:
                await self.client.abort(self.rid)
            self.client.release(self.rid)

    def _observe(self, start: float, first_at: float | None, reason: str) -> None:
        end = time.perf_counter()
        m = self.metrics
        m.e2e.observe(end - start)
        m.requests.labels(finish_reason=reason).inc()
        m.prompt_tokens.inc(len(self.prompt_ids))
        m.generation_tokens.inc(self.completion_tokens)
        if first_at is not None and self.completion_tokens > 1:
            m.tpot.observe((end - first_at) / (self.completion_tokens - 1))


def _find_stop(text: str, stops: list[str], floor: int = 0) -> tuple[int, str] | None:
    """(where, which) of the earliest stop string in `text` that ends past index `floor`."""
    found = ((text.find(s, max(floor - len(s) + 1, 0)), s) for s in stops)
    hits = [(i, s) for i, s in found if i >= 0]
    return min(hits) if hits else None
