"""kvrelay.cache.radix on its own (a real block pool, no scheduler): match, insert, lock, LRU
eviction, and its integrity check."""

from __future__ import annotations

import pytest

from kvrelay.cache.block_pool import BlockPool
from kvrelay.cache.radix import RadixCache

PS = 4


def _cache(num_pages: int = 16) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_pages)
    return pool, RadixCache(PS, pool)


def _finish(pool: BlockPool, cache: RadixCache, tokens: list[int], pages: list[int]) -> None:
    """What the scheduler does when a request ends: insert, then drop the request's refs."""
    cache.insert(tokens, pages)
    pool.free(pages)


def test_only_full_pages_are_cached_and_matched() -> None:
    pool, cache = _cache()
    toks = list(range(10))  # 2 full pages + 2 tokens
    pages = pool.alloc(3)
    assert cache.insert(toks, pages) == 2
    pool.free(pages)
    assert pool.num_used == 2 and cache.num_pages == cache.num_evictable == 2
    assert pool.refcount(pages[2]) == 0  # the partial page went back with the request
    assert cache.match(toks)[0] == pages[:2]
    assert cache.match(toks[:7])[0] == pages[:1]  # 7 tokens: one full page
    assert cache.match([0, 1, 2, 9, 4])[0] == []  # differs inside the first page
    cache.check_integrity([])


def test_a_chunk_already_cached_keeps_the_trees_page() -> None:
    pool, cache = _cache()
    a = pool.alloc(2)
    _finish(pool, cache, list(range(8)), a)
    b = pool.alloc(3)  # the same first page computed again, then a new one
    assert cache.insert(list(range(8)) + [50, 51, 52, 53], b) == 1
    pool.free(b)
    assert cache.match(list(range(8)) + [50, 51, 52, 53])[0] == [a[0], a[1], b[2]]
    assert pool.refcount(b[0]) == 0 and pool.num_used == 3
    cache.check_integrity([])


def test_a_locked_path_is_not_evicted_and_lru_goes_first() -> None:
    pool, cache = _cache()
    old, new, held = pool.alloc(1), pool.alloc(1), pool.alloc(2)
    _finish(pool, cache, [1] * PS, old)
    _finish(pool, cache, [2] * PS, new)
    _finish(pool, cache, [3] * PS * 2, held)
    pages, node = cache.match([3] * PS * 2)
    pool.share(pages)  # a request now uses that path
    cache.lock(node)
    cache.match([2] * PS)  # touched: more recent than [1]
    cache.check_integrity([node])
    assert cache.num_evictable == 2
    assert cache.evict(1) == 1 and cache.match([1] * PS)[0] == []  # least recently used went
    assert cache.evict(10) == 1  # only [2] is left to evict: the locked path stays
    assert cache.match([3] * PS * 2)[0] == held
    cache.unlock(node)
    pool.free(pages)
    assert cache.num_evictable == 2 and cache.evict(10) == 2  # leaf first, then its parent
    assert pool.num_used == 0 and cache.num_pages == 0
    cache.check_integrity([])


def test_integrity_check_catches_a_lock_nobody_holds() -> None:
    pool, cache = _cache()
    _finish(pool, cache, [1] * PS, pool.alloc(1))
    _, node = cache.match([1] * PS)
    cache.lock(node)
    with pytest.raises(AssertionError, match="lock"):
        cache.check_integrity([])
    cache.unlock(node)
    with pytest.raises(ValueError):
        cache.unlock(node)
