"""Prefix cache: a radix tree over token ids whose edges are one full KV page of tokens.

Each node holds the page whose KV covers its chunk of tokens (page_size ids) following its
parent's; the tree holds one reference to that page in the block pool. A request that matches a
path shares its pages (the scheduler adds its own reference and `lock`s the path) and computes
only what follows, starting at a page boundary: a shared page is never written. When a request
ends, `insert` adds its full computed pages (the tree takes a reference to the new ones; chunks
already in the tree keep the tree's page). Only full pages are cached: a partial last page stays
private to its request.

Invariants (`check_integrity`): a node's `lock` is the number of requests whose matched path ends
at it or below it, so a locked node's ancestors are locked; a node with lock 0 is held by the tree
alone (refcount 1), and every unlocked node can be evicted, leaves first, least recently used
first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from kvrelay.cache.block_pool import BlockPool


class Node:
    __slots__ = ("key", "page", "parent", "children", "lock", "last_use")

    def __init__(self, key: tuple[int, ...], page: int, parent: Node | None) -> None:
        self.key, self.page, self.parent = key, page, parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.lock = 0  # requests whose matched path passes through this node
        self.last_use = 0


class RadixCache:
    def __init__(self, page_size: int, pool: BlockPool) -> None:
        self.page_size, self.pool = page_size, pool
        self.root = Node((), 0, None)
        self.root.lock = 1  # never evicted, never counted
        self.num_pages = 0  # pages the tree holds
        self.num_evictable = 0  # of them, unlocked (held by the tree alone)
        self._leaves: set[Node] = set()  # unlocked leaves: what evict() takes first
        self._clock = itertools.count(1)
        # Totals since start (metrics): tokens asked for, tokens found, pages evicted.
        self.query_tokens = self.hit_tokens = self.evicted_pages = 0

    def _chunks(self, tokens: Sequence[int], num_pages: int):
        ps = self.page_size
        for i in range(num_pages):
            yield tuple(tokens[i * ps : (i + 1) * ps])

    def match(self, tokens: Sequence[int]) -> tuple[list[int], Node]:
        """The pages of the longest cached prefix of `tokens` made of full pages, and the node
        it ends at (the root when nothing matches). Marks the path as used now."""
        node, pages, now = self.root, [], next(self._clock)
        for key in self._chunks(tokens, len(tokens) // self.page_size):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            node.last_use = now
            pages.append(node.page)
        return pages, node

    def lock(self, node: Node) -> None:
        """A request now uses the path ending at `node` (its pages cannot be evicted)."""
        while node is not self.root:
            if node.lock == 0:
                self.num_evictable -= 1
                self._leaves.discard(node)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock <= 0:
                raise ValueError("prefix cache node unlocked more often than it was locked")
            node.lock -= 1
            if node.lock == 0:
                self.num_evictable += 1
                if not node.children:
                    self._leaves.add(node)
            node = node.parent

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Cache the full pages of a request's computed `tokens` (`pages`: its pages, in order);
        returns how many pages the tree took a reference to (chunks it already held keep the
        tree's page, and the request's copy goes back with the request)."""
        n = min(len(tokens) // self.page_size, len(pages))
        node, now, added = self.root, next(self._clock), 0
        for i, key in enumerate(self._chunks(tokens, n)):
            child = node.children.get(key)
            if child is None:
                child = Node(key, pages[i], node)
                self.pool.share([pages[i]])
                self._leaves.discard(node)  # no longer a leaf
                node.children[key] = child
                self._leaves.add(child)
                self.num_pages += 1
                self.num_evictable += 1
                added += 1
            node = child
            node.last_use = now
        return added

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unlocked pages, least recently used leaves first; returns how
        many went back to the pool."""
        heap = [(n.last_use, id(n), n) for n in self._leaves]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            self._leaves.discard(node)
            self.pool.free([node.page])
            self.num_pages -= 1
            self.num_evictable -= 1
            self.evicted_pages += 1
            freed += 1
            if parent is not self.root and parent.lock == 0 and not parent.children:
                self._leaves.add(parent)
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return freed

    def pages(self) -> list[int]:
        """Every page the tree holds (one reference each)."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root:
                out.append(node.page)
        return out

    def check_integrity(self, matched: Sequence[Node]) -> None:
        """Locks, counts and leaves agree with `matched` (the node each request holding a match
        ends at), and an unlocked node is held by the tree alone."""
        direct: dict[int, int] = {}
        for n in matched:
            direct[id(n)] = direct.get(id(n), 0) + 1
        problems: list[str] = []
        order, stack = [], [self.root]
        while stack:  # pre-order; walked backwards, children come before their parent
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        locks: dict[int, int] = {}
        leaves: set[Node] = set()
        count = {"pages": 0, "unlocked": 0}
        for node in reversed(order):
            n = direct.get(id(node), 0) + sum(locks[id(c)] for c in node.children.values())
            locks[id(node)] = n
            if node is self.root:
                continue
            count["pages"] += 1
            if node.lock != n:
                problems.append(f"page {node.page}: lock {node.lock}, {n} requests use it")
            if node.lock == 0:
                count["unlocked"] += 1
                if self.pool.refcount(node.page) != 1:
                    problems.append(
                        f"unlocked page {node.page} has {self.pool.refcount(node.page)} references"
                    )
                if not node.children:
                    leaves.add(node)
        if count["pages"] != self.num_pages or count["unlocked"] != self.num_evictable:
            problems.append(
                f"counted {count['pages']} pages / {count['unlocked']} unlocked, the tree says "
                f"{self.num_pages} / {self.num_evictable}"
            )
        if leaves != self._leaves:
            problems.append("the set of evictable leaves is stale")
        if problems:
            raise AssertionError("prefix cache broken: " + "; ".join(problems[:4]))
