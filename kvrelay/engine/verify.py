"""Sampling of a step in which requests verify drafts (speculative decoding): which tokens each
sampling request emits, with their logprobs.

A request with K drafts has K + 1 logits rows (after its last known token and after each draft);
row i is sampled as plain decoding would sample it with drafts[:i] appended to the output
(penalties and min_tokens see them), so each emitted token is chosen from exactly the
distribution plain decoding would use at its position. Temperature 0: the rows' argmax, then
spec/acceptance.accept_greedy (token for token the plain output). Temperature > 0:
accept_sampled over the rows' filtered distributions (the target distribution is kept; the
tokens differ from plain decoding's draws). A request without drafts samples exactly as in a
plain step. Logprobs are those of each emitted token under its row's raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.engine.messages import TokenLogprob
from kvrelay.engine.sampler import constrain, filter_probs, race, score
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.spec.acceptance import accept_greedy, accept_sampled


@dataclass
class Emitted:
    """One sampling request's tokens of this step (1 + accepted drafts at most)."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[TokenLogprob] | None]
    accepted: int  # drafts the acceptance rule kept (0 without drafts)


def sample_verify(
    logits: torch.Tensor,
    sampling: list[ScheduledRequest],
    bitmask: torch.Tensor | None,
    deterministic: bool,
    eos_ids: tuple[int, ...],
) -> list[Emitted]:
    """logits: [sum(1 + len(draft)), V] float32, each sampling request's rows in batch order;
    bitmask over the same rows (a constrained request never drafts: one row) or None."""
    params, outputs, gens, spans = [], [], [], []
    for s in sampling:
        r, d = s.req, s.draft
        spans.append((len(params), len(d) + 1))
        p = r.params
        # Only penalties and min_tokens read a row's output: copy it only for them.
        reads = p.presence_penalty or p.frequency_penalty or p.min_tokens > len(r.output_ids)
        for i in range(len(d) + 1):
            params.append(p)
            outputs.append(r.output_ids + d[:i] if reads and i else r.output_ids)
            gens.append(r.generator)
    constrained = constrain(logits, params, outputs, bitmask, eos_ids)
    chosen = constrained.argmax(dim=1)
    # Requests without drafts draw as in a plain step (the same generator calls).
    plain = [first for (first, _), s in zip(spans, sampling, strict=True) if not s.draft]
    hot = [i for i in plain if params[i].temperature > 0]
    race(constrained, chosen, params, gens, hot, deterministic)
    targets = chosen.tolist()
    emitted: list[list[int]] = []
    for (first, n), s in zip(spans, sampling, strict=True):
        if not s.draft:
            emitted.append([targets[first]])
        elif s.req.params.temperature > 0:
            rows = constrained[first : first + n]
            probs = filter_probs(rows, params[first : first + n], deterministic)
            toks = accept_sampled(s.draft, probs, s.req.generator)
            chosen[first : first + len(toks)] = torch.tensor(toks, device=chosen.device)
            emitted.append(toks)
        else:
            emitted.append(accept_greedy(s.draft, targets[first : first + n]))
    lps, tops = score(logits, params, chosen, deterministic)
    out = []
    for (first, _), toks in zip(spans, emitted, strict=True):
        end = first + len(toks)
        out.append(Emitted(toks, lps[first:end], tops[first:end], len(toks) - 1))
    return out
