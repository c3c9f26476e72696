"""Prompt logprobs computed inside the prefill: which rows of a step need them, and the head,
log-softmax, rank and top-k over those rows only.

A request that asks for prompt logprobs (`SamplingParams.prompt_logprobs`) gets, for every prompt
position p < n-1, the logprob of prompt token p+1 under the logits at p. The forward that
prefills the prompt already holds the hidden state of every position; the runner passes those
rows through the LM head here, in slices of bounded size, so no second pass runs and requests
that do not ask pay nothing (their rows never reach the head). Chunked prefill and recompute
after preemption just continue where the request's collected entries end (`Request.prompt_lp`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvrelay.engine.messages import PromptLogprob, TokenLogprob
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import ScheduledRequest

MAX_LOGIT_ELEMENTS = 1 << 25  # float32 logits of one slice of rows through the head (128 MiB)


@dataclass
class StepLogits:
    """What a runner's forward gives the engine: the sampling rows' logits [N, V] (float32, in
    batch order), and the prompt logprobs scored this step, per request that asked."""

    logits: torch.Tensor
    prompt: list[tuple[Request, list[PromptLogprob]]]


@dataclass
class PromptRows:
    """The rows of a step's tokens (in the forward's order) whose logits score a prompt token."""

    rows: list[int]
    targets: list[int]  # the prompt token each row's logits score (the next one)
    owners: list[tuple[Request, int]]  # (request, how many of the rows are its), in row order

    @property
    def top_k(self) -> int:
        return max(r.params.prompt_logprobs for r, _ in self.owners)


def plan(batch: list[ScheduledRequest]) -> PromptRows | None:
    """The rows this step must score, or None when no request of the batch wants any."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[Request, int]] = []
    first = 0
    for s in batch:
        r = s.req
        start = r.num_computed
        if r.params.prompt_logprobs is not None:
            # Positions already scored (before a preemption) are not scored twice.
            lo = max(start, len(r.prompt_lp))
            hi = min(start + s.num_new_tokens, len(r.prompt_ids) - 1)
            if hi > lo:
                rows += range(first + lo - start, first + hi - start)
                targets += r.prompt_ids[lo + 1 : hi + 1]
                owners.append((r, hi - lo))
        first += s.num_new_tokens
    return PromptRows(rows, targets, owners) if owners else None


def score(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    p: PromptRows,
) -> list[tuple[Request, list[PromptLogprob]]]:
    """hidden: [len(p.rows), H], the rows' final hidden states (before the head) -> each owner's
    entries. Logits are float32, log-softmaxed as the sampler does for generated tokens."""
    k = min(p.top_k, vocab_size)
    targets = torch.tensor(p.targets, dtype=torch.long).to(hidden.device, non_blocking=True)
    step = max(1, MAX_LOGIT_ELEMENTS // vocab_size)
    chosen, ranks, top_v, top_i = [], [], [], []
    for b in range(0, hidden.shape[0], step):
        lp = torch.log_softmax(head(hidden[b : b + step]).float(), dim=-1)
        c = lp.gather(1, targets[b : b + step, None])
        chosen.append(c.squeeze(1))
        ranks.append((lp >= c).sum(1))
        if k > 0:
            v, i = lp.topk(k, dim=1)
            top_v.append(v)
            top_i.append(i)
    chosen_l = torch.cat(chosen).tolist()
    ranks_l = torch.cat(ranks).tolist()
    tv = torch.cat(top_v).tolist() if k > 0 else [[] for _ in chosen_l]
    ti = torch.cat(top_i).tolist() if k > 0 else [[] for _ in chosen_l]
    out: list[tuple[Request, list[PromptLogprob]]] = []
    j = 0
    for r, n in p.owners:
        want = r.params.prompt_logprobs
        entries = [
            PromptLogprob(
                chosen_l[x],
                ranks_l[x],
                [TokenLogprob(t, v) for t, v in zip(ti[x][:want], tv[x][:want], strict=True)],
            )
            for x in range(j, j + n)
        ]
        out.append((r, entries))
        j += n
    return out
