"""Which prefill and which decode server a request goes to (`kvrelay router --policy`).

cache_aware (the default): each server keeps a prefix cache, so a request should go where the
longest prefix of its prompt already is: a multi-turn conversation's next turn, or the requests
that share a system prompt. The router cannot see the servers' caches, but it knows what it sent
where: it cuts each request's prompt text into blocks of BLOCK_CHARS characters, chains their
hashes (a block's hash covers every block before it, so equal hashes mean equal prefixes), and
remembers per server the hashes it sent there (least recently used forgotten past a bound, as
the server's own cache forgets). A request goes to the server believed to hold the most of its
prompt when that is at least `cache_threshold` of it (servers within one block of the best tie,
and the least loaded of them wins), unless that would tilt the load: past `balance_abs` more than
the least loaded server and `balance_rel` times it, the least loaded server wins, as it does when
no server holds enough. (SGLang's cache-aware router decides the same way, on a radix tree of
characters.) A prefix every request shares (the tools' system prompt) goes to one server until
the load tilts once; from then on both hold it.
round_robin: the servers in turn. least_load: the least loaded server.

The load (server_load.py) is max(the requests this router has in flight to the server, the
requests the server last reported running, waiting or open) plus one per 1024 prompt tokens it
reported queued; a report older than `stale_after_s` is ignored (in flight alone). A server that
reported its KV pool nearly full is loaded whatever its count: the least loaded server is one
that is not, when there is one, and a best-cached server that is nearly full is tilted against
it.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from kvrelay.router.server_load import ReportedLoad, server_load

BLOCK_CHARS = 64  # ~16 tokens of English text: about one page of the servers' caches
MAX_BLOCKS_PER_SERVER = 1 << 16  # ~4M characters remembered per server
POLICIES = ("cache_aware", "round_robin", "least_load")


def prompt_text(body: dict) -> str:
    """What the server's prefix cache sees first, as text: the tools (they go into the system
    prompt) and the messages in order for chat; the prompt (the first of a batch) otherwise."""
    if "messages" in body:
        parts = [json.dumps(body.get("tools") or [], sort_keys=True)]
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                parts.append(json.dumps(m, sort_keys=True, default=str))
        return "\x1e".join(parts)
    p = body.get("prompt", body.get("text", body.get("input_ids", "")))
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        p = p[0]  # a batch: its first prompt
    if isinstance(p, list):
        return ",".join(map(str, p))
    return p if isinstance(p, str) else ""


def block_hashes(text: str) -> list[int]:
    """Chained hashes of the full BLOCK_CHARS blocks of `text`."""
    out, h = [], 0
    for i in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        h = hash((h, text[i : i + BLOCK_CHARS]))
        out.append(h)
    return out


class ServerMemory:
    """The block hashes sent to one server, least recently used first."""

    def __init__(self, max_blocks: int = MAX_BLOCKS_PER_SERVER) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.max_blocks = max_blocks

    def matched(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` were sent here."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def remember(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)


class RoutingPolicy:
    def __init__(
        self,
        name: str = "cache_aware",
        cache_threshold: float = 0.5,
        balance_abs: int = 8,
        balance_rel: float = 1.5,
        stale_after_s: float = 5.0,
    ) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown routing policy {name!r} (one of {', '.join(POLICIES)})")
        self.name, self.cache_threshold = name, cache_threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.stale_after_s = stale_after_s
        self.inflight: dict[str, int] = {}
        self.memory: dict[str, ServerMemory] = {}
        self._turn: dict[str, int] = {}  # role -> round-robin position

    def choose(
        self,
        role: str,
        urls: Sequence[str],
        hashes: Sequence[int],
        reported: Mapping[str, ReportedLoad] | None = None,
    ) -> tuple[str, int]:
        """The server of `urls` for a request whose prompt has block `hashes`, and how many of
        those blocks it is believed to hold. `reported`: the servers' last load reports (the
        probe's), stale ones among them ignored."""
        assert urls, "no server to choose from"
        turn = self._turn.get(role, 0)
        self._turn[role] = turn + 1
        if self.name == "round_robin":
            url = urls[turn % len(urls)]
            return url, self._mem(url).matched(hashes)
        fresh = self.fresh_reports(urls, reported or {})
        load = {u: server_load(self.inflight.get(u, 0), fresh.get(u)) for u in urls}
        full = {u: u in fresh and fresh[u].nearly_full for u in urls}

        def least_loaded(among: Sequence[str]) -> str:  # ties in turn: idle servers share
            return min(among, key=lambda u: (full[u], load[u], (urls.index(u) - turn) % len(urls)))

        least = least_loaded(urls)
        match = {u: self._mem(u).matched(hashes) for u in urls}
        if self.name == "least_load":
            return least, match[least]
        top = max(match.values())
        best = least_loaded([u for u in urls if match[u] >= top - 1])
        lo, hi = load[least], load[best]
        tilted = (full[best] and not full[least]) or (
            hi - lo > self.balance_abs and hi > lo * self.balance_rel
        )
        if top == 0 or top < self.cache_threshold * len(hashes) or tilted:
            return least, match[least]
        return best, match[best]

    def fresh_reports(
        self, urls: Sequence[str], reported: Mapping[str, ReportedLoad]
    ) -> dict[str, ReportedLoad]:
        """The reports of `urls` received within the last `stale_after_s`."""
        now = time.monotonic()
        return {
            u: r
            for u in urls
            if (r := reported.get(u)) is not None and now - r.at <= self.stale_after_s
        }

    def _mem(self, url: str) -> ServerMemory:
        if url not in self.memory:
            self.memory[url] = ServerMemory()
        return self.memory[url]

    def begin(self, urls: Sequence[str], hashes: Sequence[int]) -> None:
        """A request was sent to `urls`: they will hold its prompt's blocks."""
        for u in urls:
            self.inflight[u] = self.inflight.get(u, 0) + 1
            self._mem(u).remember(hashes)

    def end(self, urls: Sequence[str]) -> None:
        for u in urls:
            self.inflight[u] = max(self.inflight.get(u, 0) - 1, 0)
