"""Hands out fixed-size KV pages. Page 0 is reserved as the dummy page that padded batch rows write to."""

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


class OutOfPages(Exception):
    pass


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (one is the dummy page)")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def check_integrity(self, held: list[list[int]]) -> None:
        """Every usable page is either free or held by exactly one request."""
        owned = [p for pages in held for p in pages]
        all_pages = sorted(owned + self._free)
        if all_pages != list(range(1, self.num_pages)):
            raise AssertionError("page accounting broken: pages leaked or double-owned")
