"""What one server reports of its load (`GET /load`, read by the PD router's probe): running and
waiting requests and KV pages from the engine's latest stats, requests this API process holds
open, and the prompt tokens not yet prefilled. All of it is state the API process already keeps:
the answer never waits on the engine or behind traffic."""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrelay.server.engine_client import EngineClient


class PromptBacklog:
    """Prompt tokens of the requests sent to the engine that have had no output yet: on a single
    or prefill server, prompts not yet prefilled (a chunked prompt counts whole until its first
    token); on a decode server, prompts whose KV has not arrived. A request leaves at its first
    output (a token, or its end) or, unseen, once the API no longer holds it (released, aborted)."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}

    def add(self, rid: str, num_tokens: int) -> None:
        self._tokens[rid] = num_tokens

    def started(self, rid: str) -> None:
        """`rid` had an output: its prompt is no longer queued."""
        self._tokens.pop(rid, None)

    def queued_tokens(self, open_rids: Container[str]) -> int:
        """The tokens queued now; requests no longer in `open_rids` are forgotten."""
        gone = [rid for rid in self._tokens if rid not in open_rids]
        for rid in gone:
            del self._tokens[rid]
        return sum(self._tokens.values())


def load_report(client: EngineClient) -> dict[str, int]:
    """The `/load` answer of a started engine client.
    `running` and `waiting` are the engine's at its latest stats (a step, or an idle refresh);
    `requests` the requests the API holds open (with PD, also those waiting for their KV or
    transfer, which the engine's counts leave out); `free_pages` counts the pages only the
    prefix cache holds as free (it evicts them on demand)."""
    s, r = client.stats, client.ready
    total = s.kv_pages_total if s is not None else r.max_total_tokens // max(r.page_size, 1)
    used = s.kv_pages_used if s is not None else 0
    return {
        "running": s.num_running if s is not None else 0,
        "waiting": s.num_waiting if s is not None else 0,
        "requests": len(client.queues),
        "queued_prompt_tokens": client.backlog.queued_tokens(client.queues),
        "free_pages": max(total - used, 0),
        "total_pages": total,
    }
