"""Prefix cache: a radix tree over token ids whose edges are one full KV page of tokens.

Each node holds the page whose KV covers its chunk of tokens (page_size ids) following its
parent's; the tree holds one reference to that page in the block pool. A request that matches a
path shares its pages (the scheduler adds its own reference and `lock`s the path) and computes
only what follows, starting at a page boundary: a shared page is never written. When a request
ends, `insert` adds its full computed pages (the tree takes a reference to the new ones; chunks
already in the tree keep the tree's page). Only full pages are cached: a partial last page stays
private to its request.

With a host tier (host_tier.py), an evicted page is offloaded instead of dropped: its node stays
in the tree with a host slot instead of a device page, and a later match that reaches it loads
it back into a fresh device page (every copy goes through the tier's gate, which the forward
waits on). Host nodes hang below device nodes only (eviction takes device leaves; a load brings
back a path's host part from the top), and the host tier evicts its own least recently used
leaves to make room.

Pages a request cannot resume after: a model with a sliding window (DeepSeek-V4) reads, when a
request resumes at a page boundary, the window rows of the tokens just before it (and the
compressor state kept at that page's end). A PD decode caches the pages it receives, but prefill
sends those rows only for a hit at the prompt's last full page boundary (paging.resume_rows_from),
so the pages ending before it are cached as not resumable (`Node.resumable` False; the rest of
their KV, which a request passing through them reads, is there). `match` ends at the deepest
resumable node of the matched path; the nodes past it stay (a longer prompt may pass through them
to a resumable node deeper). A page for the same tokens computed here, inserted later, replaces a
node's page that is not resumable.

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
from kvrelay.cache.host_tier import HostTier


class Node:
    __slots__ = ("key", "page", "host", "parent", "children", "lock", "last_use", "resumable")

    def __init__(
        self, key: tuple[int, ...], page: int, parent: Node | None, resumable: bool = True
    ) -> None:
        self.key, self.page, self.parent = key, page, parent
        # a request can resume at its end (the rows it reads back are there); stays with the node
        self.resumable = resumable
        self.host = 0  # host slot while the page lives in the host tier (then page is 0)
        self.children: dict[tuple[int, ...], Node] = {}
        self.lock = 0  # requests whose matched path passes through this node
        self.last_use = 0


class RadixCache:
    def __init__(self, page_size: int, pool: BlockPool, host: HostTier | None = None) -> None:
        self.page_size, self.pool, self.host = page_size, pool, host
        self.root = Node((), 0, None)
        self.root.lock = 1  # never evicted, never counted
        self.num_pages = 0  # device pages the tree holds
        self.num_evictable = 0  # of them, unlocked (held by the tree alone)
        self.num_host_pages = 0  # nodes whose page lives in the host tier
        self._leaves: set[Node] = set()  # unlocked device nodes without device children
        self._host_leaves: set[Node] = set()  # unlocked host nodes without children
        self._clock = itertools.count(1)
        # Totals since start (metrics): tokens asked for, tokens found, device pages evicted.
        self.query_tokens = self.hit_tokens = self.evicted_pages = 0

    def _chunks(self, tokens: Sequence[int], num_pages: int):
        ps = self.page_size
        for i in range(num_pages):
            yield tuple(tokens[i * ps : (i + 1) * ps])

    def _refresh(self, node: Node) -> None:
        """Put node in the eviction set it belongs to now (if any)."""
        if node is self.root:
            return
        self._leaves.discard(node)
        self._host_leaves.discard(node)
        if node.lock:
            return
        if node.page:
            if not any(c.page for c in node.children.values()):
                self._leaves.add(node)
        elif not node.children:
            self._host_leaves.add(node)

    def match(self, tokens: Sequence[int]) -> tuple[list[int], Node]:
        """The pages of the longest cached prefix of `tokens` made of full pages that a request
        can resume after (the rows it reads back there are present), and the node it ends at (the
        root when nothing matches). Marks the path as used now. Pages found in the host tier are
        loaded back first, as many as device pages can be made free for."""
        path, now = self._walk(tokens), next(self._clock)
        for node in path:
            node.last_use = now
        while path and not path[-1].resumable:  # a request resuming after it would lack rows
            path.pop()
        on_device = next((i for i, n in enumerate(path) if not n.page), len(path))
        if on_device < len(path):
            path = path[:on_device] + self._load(path[on_device:])
        return [n.page for n in path], path[-1] if path else self.root

    def _walk(self, tokens: Sequence[int]) -> list[Node]:
        """The nodes of the longest cached prefix of `tokens` made of full pages, top first."""
        node, path = self.root, []
        for key in self._chunks(tokens, len(tokens) // self.page_size):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def node_at(self, tokens: Sequence[int]) -> Node:
        """The node where the cached path of `tokens`' full pages ends, resumable or not (a
        request that inserted them locks it: its pages there stay)."""
        path = self._walk(tokens)
        return path[-1] if path else self.root

    def _load(self, nodes: list[Node]) -> list[Node]:
        """Bring host nodes (a path's host part, top first) back into fresh device pages, as
        many as fit; returns those loaded."""
        self.lock(nodes[-1])  # the whole path stays while eviction makes room
        n = min(len(nodes), self.pool.num_free + self.num_evictable)
        if n > self.pool.num_free:
            self.evict(n - self.pool.num_free)
        pairs = []
        for node, page in zip(nodes[:n], self.pool.alloc(n), strict=True):
            pairs.append((node.host, page))
            self.host.slots.free([node.host])  # reused only by copies queued after this one
            node.host, node.page = 0, page
        self.host.gate.copy_in(pairs)
        self.num_pages += n
        self.num_host_pages -= n
        self.host.loaded += n
        self.unlock(nodes[-1])
        return nodes[:n]

    def lock(self, node: Node) -> None:
        """A request now uses the path ending at `node` (its pages cannot be evicted)."""
        while node is not self.root:
            if node.lock == 0 and node.page:
                self.num_evictable -= 1
            node.lock += 1
            self._refresh(node)
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock <= 0:
                raise ValueError("prefix cache node unlocked more often than it was locked")
            node.lock -= 1
            if node.lock == 0 and node.page:
                self.num_evictable += 1
            self._refresh(node)
            node = node.parent

    def insert(self, tokens: Sequence[int], pages: Sequence[int], resume_from: int = 0) -> int:
        """Cache the full pages of a request's computed `tokens` (`pages`: its pages, in order;
        those of them ending before token `resume_from` are not resumable, see
        Request.resume_from); returns how many pages the tree took a reference to (chunks it
        already held keep the tree's page, and the request's copy goes back with the request,
        unless only the request's is resumable; a chunk in the host tier takes the request's
        page, which holds the same KV, and frees its host slot)."""
        n = min(len(tokens) // self.page_size, len(pages))
        node, now, added = self.root, next(self._clock), 0
        for i, key in enumerate(self._chunks(tokens, n)):
            child = node.children.get(key)
            resumable = (i + 1) * self.page_size >= resume_from
            if child is not None and child.page and child.page != pages[i]:
                if resumable and not child.resumable:
                    # The request's own page (a shared one would be the tree's) has the rows: it
                    # replaces the tree's, whose other holders keep their references.
                    self.pool.free([child.page])
                    child.page, child.resumable = self.pool.share([pages[i]])[0], True
                    added += 1
            elif child is None or not child.page:
                if child is None:
                    child = node.children[key] = Node(key, pages[i], node, resumable)
                else:
                    self.host.slots.free([child.host])
                    child.host, child.page = 0, pages[i]
                    child.resumable = resumable
                    self.num_host_pages -= 1
                self.pool.share([pages[i]])
                self.num_pages += 1
                self.num_evictable += 1
                added += 1
                self._refresh(node)  # no longer a leaf
                self._refresh(child)
            node = child
            node.last_use = now
        return added

    def evict(self, num_pages: int, offload: bool = True) -> int:
        """Free up to `num_pages` unlocked device pages, least recently used leaves first
        (offloaded to the host tier if there is one, else dropped); returns how many went back
        to the pool."""
        heap = [(n.last_use, id(n), n) for n in self._leaves]
        heapq.heapify(heap)
        freed, pairs = 0, []
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            if node not in self._leaves:  # stale: no longer evictable
                continue
            page, parent = node.page, node.parent
            slot = self._host_slot() if offload else 0
            if slot:
                pairs.append((page, slot))
                node.host, node.page = slot, 0
                self.num_host_pages += 1
                self.host.offloaded += 1
            else:
                if node.children:  # its host children would hang below nothing
                    raise AssertionError("a device page with host children cannot be dropped")
                del parent.children[node.key]
            self.pool.free([page])  # written again only after the gate (this copy queued first)
            self.num_pages -= 1
            self.num_evictable -= 1
            self.evicted_pages += 1
            freed += 1
            self._leaves.discard(node)
            if node.host:
                self._refresh(node)
            self._refresh(parent)
            if parent in self._leaves:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        if pairs:
            self.host.gate.copy_out(pairs)
        return freed

    def _host_slot(self) -> int:
        """A free host slot (evicting the host tier's least recently used page if it is full),
        or 0: no host tier, or nothing it holds can go."""
        if self.host is None:
            return 0
        if not self.host.slots.num_free and not self.evict_host(1):
            return 0
        return self.host.slots.alloc(1)[0]

    def evict_host(self, num_pages: int) -> int:
        """Drop up to `num_pages` host-tier pages, least recently used leaves first."""
        heap = [(n.last_use, id(n), n) for n in self._host_leaves]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            self._host_leaves.discard(node)
            self.host.slots.free([node.host])
            node.host = 0
            self.num_host_pages -= 1
            self.host.evicted += 1
            freed += 1
            self._refresh(parent)
            if parent in self._host_leaves:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return freed

    def flush(self) -> int:
        """Drop everything unlocked, host tier included; returns the device pages freed."""
        if self.host is not None:
            self.evict_host(self.num_host_pages)
        return self.evict(self.num_evictable, offload=False)

    def _nodes(self) -> list[Node]:
        """Every node but the root, parents before their children."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            out.append(node)
        return out[1:]

    def pages(self) -> list[int]:
        """Every device page the tree holds (one reference each)."""
        return [n.page for n in self._nodes() if n.page]

    def host_slots(self) -> list[int]:
        """Every host slot the tree holds."""
        return [n.host for n in self._nodes() if not n.page]

    def check_integrity(self, matched: Sequence[Node]) -> None:
        """Locks, counts and leaves agree with `matched` (the node each request holding a match
        ends at), and an unlocked node is held by the tree alone."""
        direct: dict[int, int] = {}
        for n in matched:
            direct[id(n)] = direct.get(id(n), 0) + 1
        problems: list[str] = []
        order = [self.root, *self._nodes()]  # walked backwards, children come before parents
        locks: dict[int, int] = {}
        leaves: set[Node] = set()
        host_leaves: set[Node] = set()
        count = {"pages": 0, "unlocked": 0, "host": 0}
        for node in reversed(order):
            n = direct.get(id(node), 0) + sum(locks[id(c)] for c in node.children.values())
            locks[id(node)] = n
            if node is self.root:
                continue
            if node.lock != n:
                problems.append(f"page {node.page}/{node.host}: lock {node.lock}, {n} use it")
            if bool(node.page) == bool(node.host):
                problems.append(f"node {node.key[:2]} has page {node.page} and slot {node.host}")
            if not node.page:  # host tier: never locked, never above a device node
                count["host"] += 1
                if any(c.page for c in node.children.values()):
                    problems.append(f"host slot {node.host} has a device page below it")
                if not node.children and not node.lock:
                    host_leaves.add(node)
                continue
            count["pages"] += 1
            if node.lock == 0:
                count["unlocked"] += 1
                if self.pool.refcount(node.page) != 1:
                    problems.append(
                        f"unlocked page {node.page} has {self.pool.refcount(node.page)} references"
                    )
                if not any(c.page for c in node.children.values()):
                    leaves.add(node)
        if (count["pages"], count["unlocked"], count["host"]) != (
            self.num_pages,
            self.num_evictable,
            self.num_host_pages,
        ):
            problems.append(
                f"counted {count} pages / unlocked / host, the tree says "
                f"{self.num_pages} / {self.num_evictable} / {self.num_host_pages}"
            )
        if leaves != self._leaves or host_leaves != self._host_leaves:
            problems.append("the set of evictable leaves is stale")
        if self.host is not None:
            try:
                self.host.slots.check_integrity([self.host_slots()])
            except AssertionError as e:
                problems.append(str(e))
        elif count["host"]:
            problems.append("host pages without a host tier")
        if problems:
            raise AssertionError("prefix cache broken: " + "; ".join(problems[:4]))
