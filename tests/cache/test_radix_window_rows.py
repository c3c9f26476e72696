"""kvrelay.cache.radix with pages cached lacking sliding-window rows (a PD decode's received
pages before the prompt's last full one): a match never ends where a request resuming there
would read absent rows, the nodes past it stay, and a page computed here for the same tokens
makes the node whole."""

from __future__ import annotations

from kvrelay.cache.block_pool import BlockPool
from kvrelay.cache.radix import RadixCache

PS = 4
TOKENS = list(range(16))  # 4 full pages


def _cache(lookback: int) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(32)
    return pool, RadixCache(PS, pool, lookback=lookback)


def _received(pool: BlockPool, cache: RadixCache, rows_from: int) -> list[int]:
    """A received 4-page prompt whose window rows start at token `rows_from`, then released."""
    pages = pool.alloc(4)
    cache.insert(TOKENS, pages, rows_from)
    pool.free(pages)
    return pages


def test_a_match_ends_at_the_deepest_page_whose_window_rows_are_all_there() -> None:
    pool, cache = _cache(lookback=3)  # the window reads 3 tokens back: the last page alone
    pages = _received(pool, cache, rows_from=8)  # pages 0 and 1 lack rows, 2 and 3 hold them
    assert cache.match(TOKENS)[0] == pages
    assert cache.match(TOKENS[:12])[0] == pages[:3]
    assert cache.match(TOKENS[:8])[0] == []  # would resume after page 1: its rows are absent
    assert cache.match(TOKENS[:7])[0] == []
    assert cache.num_pages == 4  # the nodes a longer prompt passes through stay
    cache.check_integrity([])


def test_a_window_over_two_pages_needs_both_complete() -> None:
    pool, cache = _cache(lookback=6)  # a resume reads the 2 pages before it
    pages = _received(pool, cache, rows_from=8)
    assert cache.match(TOKENS)[0] == pages  # pages 2 and 3 hold their rows
    assert cache.match(TOKENS[:12])[0] == []  # page 1 (before 12 - 6 = 6..11) lacks them


def test_without_a_window_nothing_is_ever_incomplete_for_a_match() -> None:
    pool, cache = _cache(lookback=0)
    pages = _received(pool, cache, rows_from=8)
    assert cache.match(TOKENS[:8])[0] == pages[:2]


def test_a_page_computed_here_makes_an_incomplete_node_whole() -> None:
    pool, cache = _cache(lookback=3)
    old = _received(pool, cache, rows_from=12)  # pages 0..2 lack rows
    own = pool.alloc(2)  # the first 8 tokens computed here: every row
    assert cache.insert(TOKENS[:8], own) == 2
    pool.free(own)
    assert cache.match(TOKENS[:8])[0] == own
    assert cache.match(TOKENS)[0] == own + old[2:]  # the rest of the path kept its pages
    assert pool.refcount(old[0]) == pool.refcount(old[1]) == 0  # the tree's old ones went back
    again = pool.alloc(2)  # a whole node keeps its page
    assert cache.insert(TOKENS[:8], again) == 0
    pool.free(again)
    cache.check_integrity([])


def test_a_locked_incomplete_node_takes_a_whole_page_its_holders_keep_theirs() -> None:
    """A request that passes through an incomplete node to a complete one holds the node's page;
    a whole page replacing it in the tree leaves that request's reference alone."""
    pool, cache = _cache(lookback=3)
    old = _received(pool, cache, rows_from=8)
    pages, node = cache.match(TOKENS)
    pool.share(pages)  # a request resumes after page 3, through pages 0 and 1
    cache.lock(node)
    own = pool.alloc(2)
    cache.insert(TOKENS[:8], own)
    pool.free(own)
    assert pool.refcount(old[0]) == 1 and pool.refcount(own[0]) == 1  # the request's, the tree's
    cache.check_integrity([node])
    cache.unlock(node)
    pool.free(pages)
    assert pool.refcount(old[0]) == 0
    cache.check_integrity([])
    assert cache.flush() == 4 and pool.num_used == 0
