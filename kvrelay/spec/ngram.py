"""N-gram drafts (prompt lookup): agentic traffic copies spans from tool results and earlier
turns, so the tokens that followed the latest earlier occurrence of the context's last n tokens
are a free guess at what comes next. The index is kept incrementally (one dict per n from
`min_n` to `max_n`, n-gram -> the position that followed its latest occurrence), so a proposal
costs O(max_n) whatever the context length."""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram window sizes need 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.follower: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)
        }

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            i = len(self.tokens)
            # Every n-gram ending just before t is now followed by position i (t). The context's
            # own suffix goes in only once a token follows it, so a lookup finds earlier ones.
            for n, table in self.follower.items():
                if i >= n:
                    table[tuple(self.tokens[i - n : i])] = i
            self.tokens.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens: what followed the latest earlier occurrence of the longest
        suffix (max_n down to min_n tokens) that occurred before; [] when none did."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            pos = self.follower[n].get(tuple(toks[len(toks) - n :]))
            if pos is not None:
                return toks[pos : pos + k]
        return []
