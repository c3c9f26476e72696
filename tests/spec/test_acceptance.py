"""Speculative acceptance rules (spec/acceptance.py) on a small Markov-chain "model" whose
distribution after any context is known exactly: greedy speculation gives token for token the
plain greedy output whatever the drafts; sampled speculation gives sequences distributed as
plain sampling (a chi-square test over every sequence of 3 tokens from 3, with n-gram drafts,
random point-mass drafts and drafts sampled from a different distribution), and the test tells
a wrong rule apart. Seeds are fixed: the verdicts are the same on every machine."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import torch

from kvrelay.spec.acceptance import accept_greedy, accept_sampled
from kvrelay.spec.ngram import NgramIndex

V, L, N = 3, 3, 6000
T = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.45, 0.05, 0.5]], dtype=torch.float64)
Q = torch.tensor([[0.1, 0.1, 0.8], [0.7, 0.2, 0.1], [0.3, 0.4, 0.3]], dtype=torch.float64)


def _probs(ctx: list[int], start: int, k: int) -> torch.Tensor:
    """The chain's distribution after each prefix ctx[:start + i], i = 0..k."""
    return torch.stack([T[ctx[start - 1 + i]] for i in range(k + 1)])


def _sequence(gen, drafter, rule=accept_sampled) -> tuple[int, ...]:
    seq = [0]
    while len(seq) <= L:
        draft, q = drafter(seq)
        out = rule(draft, _probs(seq + draft, len(seq), len(draft)), gen, q)
        seq += out
    return tuple(seq[1 : L + 1])


def _chi2(counts: Counter) -> float:
    stat = 0.0
    for s in itertools.product(range(V), repeat=L):
        p, prev = 1.0, 0
        for x in s:
            p, prev = p * float(T[prev, x]), x
        stat += (counts[s] - N * p) ** 2 / (N * p)
    return stat


DOF = V**L - 1
LIMIT = DOF + 6 * math.sqrt(2 * DOF)  # ~6 sigma above the chi-square mean: a false alarm never


def _ngram_drafter(seq):
    idx = NgramIndex(1, 2)
    idx.extend(seq)
    return idx.propose(3), None


def _random_drafter(rng):
    return lambda seq: ([rng.randrange(V) for _ in range(rng.randrange(0, 4))], None)


def _sampled_drafter(gen):
    def draft(seq):  # the drafter samples its tokens from its own chain Q
        toks, qs, prev = [], [], seq[-1]
        for _ in range(3):
            x = int(torch.multinomial(Q[prev], 1, generator=gen))
            toks.append(x)
            qs.append(Q[prev])
            prev = x
        return toks, torch.stack(qs)

    return draft


def test_sampled_speculation_keeps_the_target_distribution():
    for name, make in (
        ("ngram", lambda g, r: _ngram_drafter),
        ("random", lambda g, r: _random_drafter(r)),
        ("sampled", lambda g, r: _sampled_drafter(g)),
    ):
        gen, rng = torch.Generator().manual_seed(1), random.Random(2)
        drafter = make(gen, rng)
        counts = Counter(_sequence(gen, drafter) for _ in range(N))
        assert _chi2(counts) < LIMIT, name


def test_a_rule_that_keeps_every_draft_is_caught():
    def keep_all(draft, probs, gen, q):
        return [*draft, int(torch.multinomial(probs[len(draft)], 1, generator=gen))]

    gen, rng = torch.Generator().manual_seed(1), random.Random(2)
    counts = Counter(_sequence(gen, _random_drafter(rng), keep_all) for _ in range(N))
    assert _chi2(counts) > 10 * LIMIT


def test_greedy_speculation_is_plain_greedy_whatever_the_drafts():
    def greedy_after(ctx):  # a deterministic "model" with repeating stretches
        return int(torch.argmax(T[ctx[-1]])) if len(ctx) % 3 else (ctx[-1] + 1) % V

    plain = [0]
    for _ in range(60):
        plain.append(greedy_after(plain))
    rng = random.Random(5)
    steps = {}
    for name, drafter in (("ngram", _ngram_drafter), ("random", _random_drafter(rng))):
        seq, steps[name] = [0], 0
        while len(seq) < len(plain):
            draft, _ = drafter(seq)
            ctx = seq + draft
            target = [greedy_after(ctx[: len(seq) + i]) for i in range(len(draft) + 1)]
            seq += accept_greedy(draft, target)
            steps[name] += 1
        assert seq[: len(plain)] == plain, name
    assert steps["ngram"] < 0.75 * (len(plain) - 1), steps  # drafts of repeats were kept
