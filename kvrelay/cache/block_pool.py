"""Refcounted ids of fixed-size cache blocks (KV pages, or per-request state slots).

Id 0 is never handed out (the dummy page padded batch rows write to; the "no slot" slot). A block
returns to the free list when its last reference is dropped, so several owners can hold the same
block: a prefix cache sharing a prompt's pages, or a fence keeping a failed transfer's pages
until its peer can no longer write into them.
"""

from __future__ import annotations

from collections import Counter


class OutOfPages(Exception):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, what: str = "page") -> None:
        if num_blocks < 2:
            raise ValueError(f"a {what} pool needs at least 2 {what}s (id 0 is never handed out)")
        self.num_blocks, self.what = num_blocks, what
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def alloc(self, n: int) -> list[int]:
        """n free blocks, one reference each."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} {self.what}s, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> list[int]:
        """One more reference to each of `blocks` (all in use); returns them."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"{self.what} {b} is free: only a block in use can be shared")
        for b in blocks:
            self._refs[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; the last one puts it back in the free list."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"{self.what} {b} freed more often than it was held")
        for b in reversed(blocks):  # reversed: the next alloc() hands them out in this order
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def check_integrity(self, held: list[list[int]]) -> None:
        """Every usable block is either free or held, and held exactly as often as its refcount
        says (`held`: every owner's blocks, an owner listing each of its references)."""
        owned = Counter(b for blocks in held for b in blocks)
        free = set(self._free)
        problems = []
        if len(free) != len(self._free) or 0 in free or 0 in owned:
            problems.append("a block is free twice, or block 0 is in use")
        for b in range(1, self.num_blocks):
            if b in free and (owned[b] or self._refs[b]):
                problems.append(f"{self.what} {b} is free but held {owned[b]} times")
            elif b not in free and (owned[b] == 0 or owned[b] != self._refs[b]):
                problems.append(
                    f"{self.what} {b} has {self._refs[b]} references, its owners hold {owned[b]}"
                )
        if problems:
            raise AssertionError(
                f"{self.what} accounting broken (leaked or double-owned): "
                + "; ".join(problems[:4])
            )
