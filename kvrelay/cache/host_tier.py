"""The prefix cache's host-memory tier: where evicted prefix pages go instead of being dropped.

The radix tree (radix.py) decides which pages move; this holds the host slots they move to (a
refcounted id pool, like the device pages), the totals /metrics reports, and the gate
(host_gate.py) that moves the bytes. A slot is taken when a page is offloaded and given back
when the page is loaded again (the copy is queued first: copies run in order) or when the host
tier evicts it, least recently used first, to make room.
"""

from __future__ import annotations

import logging

import torch

from kvrelay.cache.block_pool import BlockPool
from kvrelay.cache.host_gate import HostTierGate

log = logging.getLogger("kvrelay.cache")


class HostTier:
    def __init__(self, capacity: int, gate) -> None:
        # gate: a HostTierGate, or a stand-in with copy_out / copy_in / wait (tests without
        # tensors).
        self.slots = BlockPool(capacity + 1, "host page")
        self.gate = gate
        # Totals since start (metrics): pages offloaded, loaded back, evicted from the host.
        self.offloaded = self.loaded = self.evicted = 0

    @property
    def num_pages(self) -> int:
        return self.slots.num_used

    def stats(self) -> dict[str, int]:
        return {
            "host_offloaded_pages": self.offloaded,
            "host_loaded_pages": self.loaded,
            "host_evicted_pages": self.evicted,
            "host_pages": self.num_pages,
        }


def build_host_tier(pool, gb: float, device: torch.device) -> tuple[HostTier | None, str]:
    """The host tier for `pool` holding `gb` GiB of pages, or None; and what was decided."""
    if gb <= 0:
        return None, "off (--host-cache-gb 0)"
    try:
        per_page = HostTierGate.bytes_per_page(pool)
    except ValueError as e:
        return None, f"off ({e})"
    capacity = int(gb * (1 << 30) // per_page)
    if capacity < 1:
        return None, f"off ({gb} GiB holds no page of {per_page} bytes)"
    return HostTier(capacity, HostTierGate(pool, capacity, device)), f"{capacity} pages"
