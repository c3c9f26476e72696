"""The router's upstream HTTP clients, one per LANE_WIDTH requests in flight.

httpx's connection pool walks every connection it holds on each request and each response close
(and asks the socket of each idle one whether it is readable): with one pool for 256 requests in
flight (512 connections) that walk took most of the router's CPU on a 2-core machine and delayed
its own /health by seconds. A request takes the lowest free lane for its life; lanes map onto
clients of at most 2 x LANE_WIDTH connections, created as concurrency grows.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import httpx

LANE_WIDTH = 32  # requests per client: each holds a prefill and a decode connection


class ClientLanes:
    def __init__(self, make_client: Callable[[int], httpx.AsyncClient]) -> None:
        self._make = make_client  # called with the connection limit of one client
        self.clients: list[httpx.AsyncClient] = []
        self._free: list[int] = []
        self._grow()

    def _grow(self) -> None:
        first = len(self.clients) * LANE_WIDTH
        self.clients.append(self._make(2 * LANE_WIDTH + 4))
        for lane in range(first, first + LANE_WIDTH):
            heapq.heappush(self._free, lane)

    def acquire(self) -> int:
        if not self._free:
            self._grow()
        return heapq.heappop(self._free)

    def release(self, lane: int) -> None:
        heapq.heappush(self._free, lane)

    def client(self, lane: int) -> httpx.AsyncClient:
        return self.clients[lane // LANE_WIDTH]

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()
