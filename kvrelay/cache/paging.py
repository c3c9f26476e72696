"""Page arithmetic: how many pages a token count needs, and where a request's rows sit in a pool."""

from __future__ import annotations

import torch


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold num_tokens tokens."""
    return -(-num_tokens // page_size)


def row_index(
    pages: torch.Tensor, first: int, last: int, ratio: int, page_size: int, per_page: int
) -> torch.Tensor:
    """Flat indices into a [num_pages * per_page, ...] pool of a request's rows first..last-1,
    row j covering tokens [j * ratio, (j + 1) * ratio) (ratio 1: one row per token)."""
    units = torch.arange(first, last, device=pages.device)
    return pages[units * ratio // page_size] * per_page + units % per_page


def window_rows_from(prompt_len: int, page_size: int, lookback: int) -> int:
    """The first prompt token whose sliding-window row a PD decode that caches the prompt's pages
    must receive: the prompt's last `lookback` tokens (what its own decode reads), and the whole
    pages holding the `lookback` tokens before the prompt's last full page boundary (what a later
    prefix hit resuming there reads). Whole pages, so each cached page holds all its window rows
    or is marked as lacking some (radix.py). `lookback` 0: no window, every row travels."""
    if not lookback:
        return 0
    boundary = prompt_len // page_size * page_size
    last = max(prompt_len - lookback, 0)
    if not boundary:  # no full page: no hit can end inside this prompt
        return last
    return min(last, max(boundary - lookback, 0) // page_size * page_size)
