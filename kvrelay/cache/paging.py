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


def resume_rows_from(prompt_len: int, page_size: int, lookback: int) -> int:
    """The first prompt token whose rows of a kind read `lookback` tokens back (a sliding
    window: window - 1; a per-page value: page_size) a PD decode that caches the prompt's pages
    must receive: those a later prefix hit ending at the prompt's last full page boundary reads,
    [boundary - lookback, boundary), and the prompt's last `lookback` tokens (what its own next
    step reads, all of them after that start). A prompt without a full page: the latter."""
    boundary = prompt_len // page_size * page_size
    return max((boundary or prompt_len) - lookback, 0)
