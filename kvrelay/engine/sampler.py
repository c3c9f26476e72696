"""Per-request sampling: penalties, grammar bitmask, min_tokens, temperature, top-k, top-p, min-p,
seeds, and logprobs.

min_tokens (vLLM's): until a request's output has that many tokens, its EOS ids (unless
ignore_eos) and stop_token_ids get -inf, after the grammar's mask; a row the two masks together
would leave empty keeps the grammar's choice (an output the grammar says is complete ends).

Logprobs are those of the model's own distribution (log-softmax of the raw logits), as in vLLM.
Random draws use each request's own generator, so a seeded request gives the same tokens whatever
else shares its batch. A grammar's token bitmask (engine/grammar.py) is one int32 tensor for the
whole batch, applied with torch ops outside any captured graph; rows of all ones change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.engine.messages import SamplingParams, TokenLogprob


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[TokenLogprob] | None]


def _apply_penalties(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]):
    for i, (p, out) in enumerate(zip(params, outputs, strict=True)):
        if (p.presence_penalty or p.frequency_penalty) and out:
            ids = torch.tensor(out, device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                logits.dtype
            )


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [N, W] (bit j of word w allows token 32*w + j, llguidance's layout) -> bool [N, vocab]
    of allowed tokens; tokens beyond 32*W are not allowed."""
    n, w = bitmask.shape
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(n, w * 32)
    if w * 32 >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(n, vocab - w * 32, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens get -inf, in place, batched. Only the rows that restrict anything are
    unpacked (found on the mask's own device, the CPU where llguidance filled it: no sync); rows
    of all ones are not touched."""
    rows = (bitmask != -1).any(dim=1).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    if rows.numel() == bitmask.shape[0]:
        allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), vocab)
        logits.masked_fill_(~allowed, float("-inf"))
        return
    allowed = unpack_bitmask(bitmask[rows].to(logits.device, non_blocking=True), vocab)
    rows = rows.to(logits.device, non_blocking=True)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_min_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]],
    eos_ids: tuple[int, ...],
) -> None:
    """In place: the tokens that would end an output shorter than its min_tokens are masked."""
    for i, (p, out) in enumerate(zip(params, outputs, strict=True)):
        if len(out) >= p.min_tokens:
            continue
        ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        ids = [t for t in ids if t < logits.shape[1]]
        if not ids:
            continue
        row = logits[i].index_fill(0, torch.tensor(ids, device=logits.device), float("-inf"))
        if bool(torch.isfinite(row).any()):
            logits[i] = row


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on the rows that sample; returns probabilities."""
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev)
    logits = logits / temp[:, None]
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        vocab = logits.shape[1]
        # top_k beyond the vocabulary (or 0: off) keeps every token.
        k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=dev)
        kth = torch.sort(logits, dim=1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=1)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    if (top_p < 1).any():
        sorted_p, idx = torch.sort(probs, dim=1, descending=True)
        # Keep a token if the mass strictly before it is below top_p (the top token always stays).
        drop_sorted = (torch.cumsum(sorted_p, dim=1) - sorted_p) >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    if (min_p > 0).any():
        threshold = min_p[:, None] * probs.max(dim=1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=1, keepdim=True)


def filter_probs(
    logits: torch.Tensor, params: list[SamplingParams], deterministic: bool = False
) -> torch.Tensor:
    """The distribution each row samples from (temperature, top-k, top-p, min-p); with
    `deterministic`, one row per call (batch-invariant reductions)."""
    if deterministic:
        return torch.cat([_filter(logits[i : i + 1], [p]) for i, p in enumerate(params)])
    return _filter(logits, params)


def constrain(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]],
    bitmask: torch.Tensor | None = None,
    eos_ids: tuple[int, ...] = (),
) -> torch.Tensor:
    """A copy of the logits with penalties, the grammar's mask and min_tokens applied: what the
    rows choose from."""
    logits = logits.clone()
    _apply_penalties(logits, params, outputs)
    if bitmask is not None:
        apply_token_bitmask(logits, bitmask)
    if any(p.min_tokens > len(out) for p, out in zip(params, outputs, strict=True)):
        apply_min_tokens(logits, params, outputs, eos_ids)
    return logits


def race(
    logits: torch.Tensor,
    chosen: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    rows: list[int],
    deterministic: bool = False,
) -> None:
    """Rows `rows` (temperature > 0) draw their token into `chosen`, in place."""
    if not rows:
        return
    sub = filter_probs(logits[rows], [params[i] for i in rows], deterministic)
    for j, i in enumerate(rows):
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
        e = torch.empty_like(sub[j]).exponential_(generator=generators[i])
        chosen[i] = (sub[j] / e).argmax()


def score(
    raw: torch.Tensor, params: list[SamplingParams], chosen: torch.Tensor, deterministic: bool
) -> tuple[list[float | None], list[list[TokenLogprob] | None]]:
    """The chosen tokens' logprobs and the top alternatives, for the rows that ask (the
    model's own distribution: log-softmax of the raw logits)."""
    logprobs: list[float | None] = [None] * len(params)
    tops: list[list[TokenLogprob] | None] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return logprobs, tops
    if deterministic:
        lp = torch.cat([torch.log_softmax(raw[i : i + 1], dim=1) for i in want])
    else:
        lp = torch.log_softmax(raw[want], dim=1)
    k = min(max(params[i].logprobs for i in want), lp.shape[1])
    top_v, top_i = lp.topk(k, dim=1) if k > 0 else (lp[:, :0], lp[:, :0].long())
    chosen_lp = lp.gather(1, chosen[want][:, None]).squeeze(1).tolist()
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(want):
        logprobs[i] = chosen_lp[j]
        n = params[i].logprobs
        tops[i] = [TokenLogprob(t, v) for t, v in zip(top_i[j][:n], top_v[j][:n], strict=True)]
    return logprobs, tops


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]],
    generators: list[torch.Generator],
    bitmask: torch.Tensor | None = None,
    deterministic: bool = False,
    eos_ids: tuple[int, ...] = (),
) -> SampleResult:
    """logits: [N, V] float32, one row per request that samples this step. bitmask: int32
    [N, ceil(V/32)] of allowed tokens (grammar-constrained rows; the others all ones), or None.
    Logprobs stay those of the model's own distribution (the mask does not renormalize them).
    `deterministic`: the vocabulary reductions (softmax, sums, log-softmax) run one row per
    call, so they see [1, V] whatever the batch (batch-invariant mode). `eos_ids`: the model's
    EOS tokens, masked with stop_token_ids for outputs shorter than their min_tokens."""
    logits_c = constrain(logits, params, outputs, bitmask, eos_ids)
    chosen = logits_c.argmax(dim=1)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    race(logits_c, chosen, params, generators, rows, deterministic)
    token_ids = chosen.tolist()
    logprobs, tops = score(logits, params, chosen, deterministic)
    return SampleResult(token_ids, logprobs, tops)
