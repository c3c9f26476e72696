"""kvrelay.cache.block_pool: ids handed out low first, refcounts, and the integrity check."""

from __future__ import annotations

import pytest

from kvrelay.cache.block_pool import BlockPool, OutOfPages


def test_alloc_hands_out_low_ids_and_never_block_zero() -> None:
    pool = BlockPool(5)
    assert pool.alloc(2) == [1, 2] and pool.num_free == 2 and pool.num_used == 2
    with pytest.raises(OutOfPages):
        pool.alloc(3)
    assert pool.alloc(2) == [3, 4] and pool.num_free == 0
    with pytest.raises(ValueError):
        BlockPool(1)


def test_freed_blocks_come_back_in_the_order_they_were_held() -> None:
    pool = BlockPool(8)
    a = pool.alloc(3)
    pool.alloc(2)
    pool.free(a)
    assert pool.alloc(3) == a  # a request preempted and readmitted gets the same pages


def test_a_shared_block_returns_with_its_last_reference() -> None:
    pool = BlockPool(4)
    a = pool.alloc(2)
    b = pool.share(a)
    assert [pool.refcount(x) for x in a] == [2, 2] and pool.num_free == 1
    pool.free(a)
    assert pool.num_free == 1 and pool.refcount(a[0]) == 1  # b still holds them
    pool.check_integrity([b])
    pool.free(b)
    assert pool.num_free == 3 and pool.refcount(a[0]) == 0
    pool.check_integrity([])


def test_misuse_is_refused_without_changing_anything() -> None:
    pool = BlockPool(4)
    a = pool.alloc(1)
    with pytest.raises(ValueError):
        pool.share([a[0], 2])  # 2 is free
    with pytest.raises(ValueError):
        pool.free([a[0], 3])  # 3 was never held
    assert pool.refcount(a[0]) == 1 and pool.num_free == 2
    pool.free(a)
    with pytest.raises(ValueError):
        pool.free(a)  # a double free


def test_integrity_check_counts_every_reference() -> None:
    pool = BlockPool(6)
    a, b = pool.alloc(2), pool.alloc(1)
    shared = pool.share(a[:1])
    pool.check_integrity([a, b, shared])
    with pytest.raises(AssertionError, match="references"):
        pool.check_integrity([a, b])  # a reference nobody owns: a leak
    with pytest.raises(AssertionError, match="references"):
        pool.check_integrity([a, b, shared, b])  # owned more often than counted
    with pytest.raises(AssertionError, match="free"):
        pool.check_integrity([a, b, shared, [5]])  # a free block held
