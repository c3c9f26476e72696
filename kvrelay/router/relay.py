"""Decode's SSE stream relayed to the client by the router: events passed on (with prefill's
prompt scores put in, when asked), a broken decode stream turned into an error event then
[DONE], and the request settled once (its outcome counted, its lane and its pair's load freed)
whether the stream ended, broke or the client left (then decode's response is closed, which
aborts the request)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:  # routing.py builds a Relay per stream
    from kvrelay.router.routing import Router

log = logging.getLogger("kvrelay.router")


class Relay:
    """Decode's SSE stream, relayed to the client; a broken decode stream becomes an error event."""

    def __init__(
        self,
        router: Router,
        first: str,
        lines,
        dresp: httpx.Response,
        rid: str,
        lane: int,
        patch=None,
        pair: tuple[str, str] = (),
    ) -> None:
        self.router, self.first, self.lines, self.dresp, self.rid = router, first, lines, dresp, rid
        self.lane, self.pair = lane, pair  # the pair's load counts until the stream settles
        self.patch = patch  # puts prefill's prompt scores into decode's events (None: none)
        self.ended = False  # decode's stream reached its end (or broke): the client saw it all
        self.broken = False  # decode's stream broke (the client got an error event)
        self.closed = False
        self.settled = False

    async def events(self):
        try:
            yield self.first + "\n\n"
            try:
                async for line in self.lines:
                    if line.strip() == "data: [DONE]":
                        # Settled before the client sees it: a client that leaves on [DONE]
                        # (the openai SDK does) got everything and must count as ok.
                        self.ended = True
                        self.settle()
                        yield line + "\n\n"
                        return
                    if line.strip():
                        yield (self.patch(line) if self.patch else line) + "\n\n"
            except httpx.HTTPError as e:
                self.router.failures.labels(cause="stream_broken").inc()
                log.warning("decode stream broke rid=%s error=%s", self.rid, e)
                err = {
                    "message": f"decode stream broke: {type(e).__name__}: {e}",
                    "type": "server_error",
                    "code": "stream_broken",
                }
                self.broken = True
                yield f"data: {json.dumps({'error': err})}\n\n"
                self.ended = True
                self.settle()
                yield "data: [DONE]\n\n"
            self.ended = True
        finally:
            await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.ended:
            self.router.disconnects.inc()
            log.info("client disconnected, aborting rid=%s", self.rid)
        self.settle()
        await self.dresp.aclose()

    def settle(self) -> None:
        """Count the outcome and free the request's slot, once."""
        if self.settled:
            return
        self.settled = True
        outcome = "error" if self.broken else "ok" if self.ended else "client_disconnected"
        self.router.requests.labels(outcome=outcome).inc()
        self.router.release(self.lane)
        self.router.policy.end(self.pair)
