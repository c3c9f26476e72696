"""Which drafted tokens a verification step keeps.

The target model scores the context plus K drafted tokens in one forward, giving its
distribution p_i after each prefix (K + 1 of them). Greedy: keep the drafted tokens while each
equals the target's argmax, then emit the target's own token at the first mismatch (or after
the last draft): the output is token for token what plain greedy decoding gives. Sampling
(speculative sampling, Leviathan et al. 2023 / Chen et al. 2023): keep drafted token x with
probability min(1, p(x) / q(x)), q the drafter's distribution (a point mass for n-gram drafts,
so min(1, p(x))); at the first rejection emit a sample of norm(max(p - q, 0)) and stop; all kept:
a sample of p_K. Every emitted token is then distributed exactly as plain sampling from p.
"""

from __future__ import annotations

import torch


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """The tokens emitted: `target` holds the target's argmax after each prefix (len(draft)+1)."""
    assert len(target) == len(draft) + 1
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return [*draft[:n], target[n]]


def accept_sampled(
    draft: list[int],
    probs: torch.Tensor,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """The tokens emitted. `probs` [len(draft)+1, V]: the target's distribution after each
    prefix; `draft_probs` [len(draft), V]: the drafter's (None: each draft a point mass)."""
    assert probs.shape[0] == len(draft) + 1
    out: list[int] = []
    for i, x in enumerate(draft):
        p = probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        u = float(torch.rand((), generator=generator, dtype=torch.float64, device=generator.device))
        if u * q_x < float(p[x]):  # u < min(1, p(x) / q(x))
            out.append(x)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        out.append(_sample(residual, generator))
        return out
    out.append(_sample(probs[len(draft)], generator))
    return out


def _sample(weights: torch.Tensor, generator: torch.Generator) -> int:
    w = weights.double()
    total = float(w.sum())
    if total <= 0.0:  # p put (numerically) all its mass where the draft was: nothing left
        return int(torch.argmax(weights))
    return int(torch.multinomial(w / total, 1, generator=generator))
