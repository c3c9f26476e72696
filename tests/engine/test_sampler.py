"""kvrelay.engine.sampler: greedy, top-k/top-p/min-p, temperature, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvrelay.engine.messages import SamplingParams
from kvrelay.engine.sampler import sample


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws from one row of logits (n rows sharing one seeded generator)."""
    g = _gen(seed)
    rows = logits.reshape(1, -1).expand(n, -1).contiguous()
    res = sample(rows, [params] * n, [[] for _ in range(n)], [g] * n)
    return torch.tensor(res.token_ids)


def _support(logits: torch.Tensor, params: SamplingParams, n: int = 2000) -> set[int]:
    return set(_draws(logits, params, n).tolist())


def _freqs(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def test_greedy_is_argmax() -> None:
    logits = torch.randn(8, 50, generator=_gen(0))
    params = [SamplingParams(temperature=0.0)] * 8
    res = sample(logits, params, [[] for _ in range(8)], [_gen(i) for i in range(8)])
    assert res.token_ids == logits.argmax(dim=1).tolist()
    assert res.logprobs == [None] * 8 and res.top_logprobs == [None] * 8


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(16, 50, generator=_gen(1))
    want = logits.argmax(dim=1).tolist()
    for seed in range(5):
        p = [SamplingParams(temperature=1.5, top_k=1)] * 16
        res = sample(logits, p, [[] for _ in range(16)], [_gen(seed * 100 + i) for i in range(16)])
        assert res.token_ids == want


def test_top_k_keeps_exactly_the_k_most_likely() -> None:
    # Nearly flat, so that every one of the kept tokens shows up in 2000 draws.
    logits = torch.randn(30, generator=_gen(2)) * 0.3
    for k in (1, 3, 7):
        want = set(torch.topk(logits, k).indices.tolist())
        assert _support(logits, SamplingParams(temperature=1.0, top_k=k)) == want


def test_top_k_larger_than_vocab_is_no_filter() -> None:
    # The API accepts any top_k >= -1; one request's large top_k must not fail the batch.
    logits = torch.zeros(2, 6)
    params = [SamplingParams(temperature=1.0, top_k=1000), SamplingParams(temperature=0.0)]
    res = sample(logits, params, [[], []], [_gen(0), _gen(1)])
    assert 0 <= res.token_ids[0] < 6
    assert _support(torch.zeros(6), SamplingParams(temperature=1.0, top_k=1000), 500) == set(
        range(6)
    )


# Sorted: 0.5 (id 3), 0.25 (id 1), 0.125 (id 4), 0.075 (id 2), 0.05 (id 0);
# prefix sums 0.5, 0.75, 0.875, 0.95, 1.0.
_TOP_P_PROBS = [0.05, 0.25, 0.075, 0.5, 0.125]


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.3, {3}),
        (0.45, {3}),
        (0.6, {3, 1}),
        (0.8, {3, 1, 4}),
        (0.9, {3, 1, 4, 2}),
        (0.97, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p: float, kept: set[int]) -> None:
    logits = _logits_of(_TOP_P_PROBS)
    got = _draws(logits, SamplingParams(temperature=1.0, top_p=top_p), 3000)
    assert set(got.tolist()) == kept
    # Within the kept set the probabilities are renormalised, not reshaped.
    f = _freqs(got, len(_TOP_P_PROBS))
    mass = sum(_TOP_P_PROBS[i] for i in kept)
    for i in kept:
        assert f[i].item() == pytest.approx(_TOP_P_PROBS[i] / mass, abs=0.04)


def test_top_p_one_keeps_everything() -> None:
    logits = _logits_of(_TOP_P_PROBS)
    assert _support(logits, SamplingParams(temperature=1.0, top_p=1.0), 3000) == set(range(5))


def test_min_p_drops_tokens_below_min_p_times_max() -> None:
    probs = [0.06, 0.4, 0.04, 0.3, 0.2]
    logits = _logits_of(probs)
    # threshold 0.2 * 0.4 = 0.08: drops the 0.06 and 0.04 tokens.
    assert _support(logits, SamplingParams(temperature=1.0, min_p=0.2), 3000) == {1, 3, 4}
    # threshold 0.6 * 0.4 = 0.24: keeps 0.4 and 0.3 only.
    assert _support(logits, SamplingParams(temperature=1.0, min_p=0.6), 3000) == {1, 3}
    assert _support(logits, SamplingParams(temperature=1.0, min_p=0.0), 3000) == set(range(5))


def test_temperature_matches_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    n = 4000
    top_freq = []
    for t in (0.5, 1.0, 2.0):
        f = _freqs(_draws(logits, SamplingParams(temperature=t), n, seed=int(t * 10)), 5)
        want = torch.softmax(logits / t, dim=0)
        # 5 standard deviations of a frequency from n draws is at most 0.04.
        assert (f - want).abs().max().item() < 5 * math.sqrt(0.25 / n)
        top_freq.append(f[0].item())
    assert top_freq[0] > top_freq[1] > top_freq[2]  # lower temperature: sharper


@pytest.mark.parametrize(
    ("count", "freq", "presence"),
    [(1, 0.5, 0.0), (3, 0.5, 0.0), (2, 0.0, 1.0), (4, 0.3, 0.7), (2, -0.5, 0.0), (1, 0.0, -1.5)],
)
def test_penalties_shift_the_right_logits_by_the_right_amounts(
    count: int, freq: float, presence: float
) -> None:
    shift = freq * count + presence
    vocab, tok, rival = 10, 4, 7
    # After the penalty tok sits at rival + delta: greedy probes the shift to within 0.01.
    for delta, winner in ((0.01, tok), (-0.01, rival)):
        logits = torch.zeros(2, vocab)
        logits[:, rival] = 5.0
        logits[:, tok] = 5.0 + shift + delta
        logits[:, 2] = 4.0
        raw = logits.clone()
        p = SamplingParams(temperature=0.0, frequency_penalty=freq, presence_penalty=presence)
        # Row 1 has its own history and penalties: there the rival is pushed down, not tok.
        p1 = SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0)
        outs = [[tok] * count + [9], [2, rival, rival]]
        res = sample(logits, [p, p1], outs, [_gen(0), _gen(1)])
        assert res.token_ids == [winner, tok]
        assert torch.equal(logits, raw), "sample must not modify its input logits"


def test_penalties_exact_amounts() -> None:
    from kvrelay.engine.sampler import _apply_penalties

    logits = torch.randn(2, 12, generator=_gen(3))
    before = logits.clone()
    p0 = SamplingParams(frequency_penalty=0.25, presence_penalty=0.5)
    p1 = SamplingParams()  # no penalties: untouched even with a history
    _apply_penalties(logits, [p0, p1], [[1, 1, 1, 5, 11], [1, 2, 3]])
    want = before.clone()
    want[0, 1] -= 3 * 0.25 + 0.5
    want[0, 5] -= 0.25 + 0.5
    want[0, 11] -= 0.25 + 0.5
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-6)


def test_same_seed_same_tokens_whatever_else_is_in_the_batch() -> None:
    vocab, steps = 64, 12
    logits = torch.randn(steps, vocab, generator=_gen(4))
    mine = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=42)

    def run(batch_others: int, position: int) -> list[int]:
        g = _gen(42)
        others = [_gen(1000 + i) for i in range(batch_others)]
        other_params = [
            SamplingParams(temperature=1.3, top_k=3, min_p=0.1, presence_penalty=1.0),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.5, top_p=0.5, frequency_penalty=0.5),
        ]
        toks = []
        for s in range(steps):
            rows = [torch.randn(vocab, generator=_gen(s * 10 + i)) for i in range(batch_others)]
            rows.insert(position, logits[s])
            params = [other_params[i % 3] for i in range(batch_others)]
            params.insert(position, mine)
            gens = list(others)
            gens.insert(position, g)
            outs = [[1, 2, 2] for _ in range(batch_others)]
            outs.insert(position, list(toks))
            res = sample(torch.stack(rows), params, outs, gens)
            toks.append(res.token_ids[position])
        return toks

    alone = run(0, 0)
    assert run(3, 0) == alone
    assert run(5, 2) == alone
    assert run(4, 4) == alone
    assert len(set(alone)) > 1  # it really samples


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = torch.randn(4, 40, generator=_gen(5)) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=5, presence_penalty=1.5, logprobs=3),
        SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=5),
        SamplingParams(temperature=1.0, min_p=0.3, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    outs = [[0, 1, 2], [int(logits[1].argmax())] * 3, [], []]
    res = sample(logits.clone(), params, outs, [_gen(i) for i in range(4)])
    lp = torch.log_softmax(logits, dim=1)
    for i in range(3):
        tok = res.token_ids[i]
        assert res.logprobs[i] == pytest.approx(lp[i, tok].item(), abs=1e-6)
    # Row 1's penalty moved greedy off the argmax, but its logprob is still the raw one.
    assert res.token_ids[1] != int(logits[1].argmax())
    for i, n in ((0, 3), (1, 5)):
        top = res.top_logprobs[i]
        assert len(top) == n
        vals = [t.logprob for t in top]
        assert vals == sorted(vals, reverse=True)
        ref_v, ref_i = lp[i].topk(n)
        assert [t.token_id for t in top] == ref_i.tolist()
        torch.testing.assert_close(torch.tensor(vals), ref_v, rtol=0, atol=1e-6)
    assert res.top_logprobs[2] == []
    assert res.logprobs[3] is None and res.top_logprobs[3] is None


def test_top_logprobs_longer_than_vocab_are_clamped() -> None:
    logits = torch.randn(2, 5, generator=_gen(6))
    params = [
        SamplingParams(temperature=0.0, logprobs=8),
        SamplingParams(temperature=0.0, logprobs=2),
    ]
    res = sample(logits, params, [[], []], [_gen(0), _gen(1)])
    assert len(res.top_logprobs[0]) == 5 and len(res.top_logprobs[1]) == 2


def test_min_tokens_masks_eos_and_stop_tokens_until_the_output_is_long_enough() -> None:
    """vLLM's min_tokens: EOS (unless ignore_eos) and stop_token_ids cannot be drawn while the
    output is shorter; from then on (and in rows without it) nothing changes; a grammar row
    left with nothing but an ending token keeps it."""
    logits = torch.full((5, 8), -5.0)
    logits[:, 3] = 5.0  # EOS, the most likely
    logits[:, 6] = 4.0  # a stop token id, next
    logits[:, 1] = 3.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(6,))
    outputs = [[], [9], [9, 9], [], []]
    params = [
        p,
        p,
        p,
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),
    ]
    gens = [_gen(i) for i in range(5)]
    res = sample(logits, params, outputs, gens, eos_ids=(3,))
    assert res.token_ids == [1, 1, 3, 3, 3]
    only_eos = torch.zeros(1, 1, dtype=torch.int32)
    only_eos[0, 0] = 1 << 3  # the grammar allows token 3 alone
    res = sample(logits[:1], [p], [[]], [_gen(0)], only_eos, eos_ids=(3,))
    assert res.token_ids == [3]
