"""Grammar-constrained sampling: the batched token bitmask against a per-row reference (served
structured outputs: tests/server/test_structured.py)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.messages import SamplingParams
from kvrelay.engine.sampler import apply_token_bitmask, sample, unpack_bitmask


def _reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per row, per token: bit (t % 32) of word (t // 32), read one at a time."""
    out = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool)
    words = bitmask.tolist()
    for r, row in enumerate(words):
        for t in range(vocab):
            w = t // 32
            out[r, t] = w < len(row) and (row[w] >> (t % 32)) & 1 == 1
    return out


@pytest.mark.parametrize("vocab", [96, 100, 130])  # a whole number of words, a part, beyond
def test_bitmask_matches_a_per_row_reference(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    n, words = 5, 4  # 128 bits: vocab 130 has two tokens beyond the mask (never allowed)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (n, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[2] = -1  # an unconstrained row
    want = _reference_allowed(bitmask, vocab)
    assert torch.equal(unpack_bitmask(bitmask, vocab), want)
    logits = torch.randn(n, vocab, generator=g)
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask)
    for r in (0, 1, 3, 4):
        for t in range(vocab):
            assert masked[r, t].item() == (logits[r, t].item() if want[r, t] else float("-inf"))
    assert torch.equal(masked[2], logits[2])  # an unconstrained row: bitwise the same
    every = torch.full((n, words), -1, dtype=torch.int32)
    untouched = logits.clone()
    apply_token_bitmask(untouched, every)
    assert torch.equal(untouched, logits)


def test_sample_keeps_to_the_mask_and_leaves_free_rows_alone() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, generator=g)
    bitmask = torch.full((4, 2), -1, dtype=torch.int32)
    bitmask[0] = torch.tensor([0, 1 << 5], dtype=torch.int32)  # only token 37
    bitmask[1] = torch.tensor([0b1010, 0], dtype=torch.int32)  # tokens 1 and 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)] * 2
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    res = sample(logits, params, [[]] * 4, gens, bitmask)
    free = sample(logits, params, [[]] * 4, [torch.Generator().manual_seed(i) for i in range(4)])
    assert res.token_ids[0] == 37 and res.token_ids[1] in (1, 3)
    assert res.token_ids[2:] == free.token_ids[2:]
