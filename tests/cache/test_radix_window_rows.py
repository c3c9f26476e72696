"""kvrelay.cache.radix with pages a request cannot resume after (a PD decode's received pages
ending before the prompt's last full page boundary lack window rows a resume there reads): a
match never ends on one, the nodes past it stay, and a page computed here for the same tokens
makes the node resumable."""

from __future__ import annotations

from kvrelay.cache.block_pool import BlockPool
from kvrelay.cache.radix import RadixCache

PS = 4
TOKENS = list(range(16))  # 4 full pages


def _cache() -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(32)
    return pool, RadixCache(PS, pool)


def _received(pool: BlockPool, cache: RadixCache, resume_from: int) -> list[int]:
    """A received 4-page prompt resumable at boundaries from `resume_from` on, then released."""
    pages = pool.alloc(4)
    cache.insert(TOKENS, pages, resume_from)
    pool.free(pages)
    return pages


def test_a_match_ends_at_the_deepest_page_a_request_can_resume_after() -> None:
    pool, cache = _cache()
    pages = _received(pool, cache, resume_from=12)  # after pages 2 and 3, not 0 and 1
    assert cache.match(TOKENS)[0] == pages
    assert cache.match(TOKENS[:12])[0] == pages[:3]
    assert cache.match(TOKENS[:11])[0] == []  # would resume after page 1
    assert cache.match(TOKENS[:4])[0] == []
    assert cache.num_pages == 4  # the nodes a longer prompt passes through stay
    cache.check_integrity([])


def test_a_match_passes_through_pages_it_cannot_end_on() -> None:
    pool, cache = _cache()
    first = _received(pool, cache, resume_from=16)  # only after page 3
    own = pool.alloc(1)  # page 1's tokens computed here (pages 0's shared): resumable
    cache.insert(TOKENS[:8], [first[0], own[0]])
    pool.free(own)
    assert cache.match(TOKENS[:12])[0] == [first[0], own[0]]  # ends after page 1, not 2
    assert cache.match(TOKENS)[0] == [first[0], own[0], *first[2:]]
    assert pool.refcount(first[1]) == 0  # the page it replaced went back
    cache.check_integrity([])


def test_a_page_computed_here_makes_a_node_resumable_a_resumable_one_keeps_its_page() -> None:
    pool, cache = _cache()
    old = _received(pool, cache, resume_from=16)
    own = pool.alloc(2)  # the first 8 tokens computed here
    assert cache.insert(TOKENS[:8], own) == 2
    pool.free(own)
    assert cache.match(TOKENS[:8])[0] == own
    assert pool.refcount(old[0]) == pool.refcount(old[1]) == 0
    again = pool.alloc(2)
    assert cache.insert(TOKENS[:8], again) == 0
    pool.free(again)
    received_again = pool.alloc(4)  # a page that is not resumable never replaces one
    cache.insert(TOKENS, received_again, resume_from=16)
    pool.free(received_again)
    assert cache.match(TOKENS)[0] == own + old[2:]
    cache.check_integrity([])


def test_a_locked_node_takes_a_resumable_page_its_holders_keep_theirs() -> None:
    """A request that passes through a node it cannot resume after holds the node's page; a
    resumable page replacing it in the tree leaves that request's reference alone."""
    pool, cache = _cache()
    old = _received(pool, cache, resume_from=16)
    pages, node = cache.match(TOKENS)
    pool.share(pages)  # a request resumes after page 3, through pages 0..2
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
