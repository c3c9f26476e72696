"""N-gram drafts (spec/ngram.py) against a plain scan of the whole context, on random token
streams over small vocabularies (many repeats) built incrementally."""

from __future__ import annotations

import random

import pytest

from kvrelay.spec.ngram import NgramIndex


def scan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: the longest suffix that occurred earlier, its latest earlier occurrence."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):  # occurrences ending before the end
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("vocab,min_n,max_n", [(3, 1, 4), (8, 2, 3), (50, 1, 1)])
def test_proposals_equal_a_scan_of_the_context_at_every_length(vocab, min_n, max_n):
    rng = random.Random(vocab)
    idx, toks = NgramIndex(min_n, max_n), []
    for _ in range(400):
        chunk = [rng.randrange(vocab) for _ in range(rng.choice((1, 1, 1, 5)))]
        idx.extend(chunk)
        toks += chunk
        k = rng.randrange(1, 6)
        assert idx.propose(k) == scan(toks, k, min_n, max_n), (toks[-12:], k)


def test_a_copied_span_is_proposed_and_the_longest_match_wins():
    idx = NgramIndex(1, 3)
    idx.extend([5, 6, 7, 8, 9, 1, 2, 6, 7, 3])
    idx.extend([6, 7])  # suffix (6, 7): latest earlier occurrence is followed by 3
    assert idx.propose(2) == [3, 6]
    idx.extend([8])  # (6, 7, 8) occurred once, long ago: the longest match wins over (7, 8)
    assert idx.propose(3) == [9, 1, 2]
    assert NgramIndex(2, 3).propose(4) == []
    fresh = NgramIndex(1, 2)
    fresh.extend([1, 2, 3])
    assert fresh.propose(4) == []  # nothing repeats: no draft
    with pytest.raises(ValueError):
        NgramIndex(3, 2)
