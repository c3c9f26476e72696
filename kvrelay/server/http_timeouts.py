"""Read deadlines on HTTP connections (server and router): uvicorn's h11 protocol with two timers.

uvicorn times only an idle keep-alive connection (after a response): a client that connects and
sends its headers a byte at a time, or never finishes its body (slowloris), holds a connection and
a descriptor for as long as it likes. Here:
- a request's headers must be complete within HEADER_TIMEOUT_S of the connection's start, or of
  the first byte of a next request on a kept-alive connection;
- its body within BODY_TIMEOUT_S of its headers (4 MiB, the default body limit, in 30 s: at least
  140 kB/s);
else the connection is closed (the app, if it waits for the body, sees the client leave). A
response being written or a generation running has no deadline here (the app has its own).
At most MAX_PENDING connections of a process wait for their headers at once (nothing about them
is known yet, not even an API key): past that a new connection is closed at once, so that a flood
of them leaves descriptors for the requests in flight (the router's to its servers, the engine's).
"""

from __future__ import annotations

import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kvrelay.http")

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
MAX_PENDING = 1024  # the servers raise their open-files limit to 4096


class ReadTimeouts:
    """What the timers closed since start, and when the last line about it was logged."""

    def __init__(self) -> None:
        self.closed = {"headers": 0, "body": 0, "refused": 0}
        self._logged = 0.0

    def count(self, phase: str, client) -> None:
        self.closed[phase] += 1
        now = time.monotonic()
        if now - self._logged >= 1.0:  # a slowloris flood must not flood the log
            self._logged = now
            log.warning(
                "connection closed cause=read_timeout phase=%s client=%s closed_so_far=%s",
                phase,
                client,
                self.closed,
            )


READ_TIMEOUTS = ReadTimeouts()  # this process's totals (one listener per process)


class TimedH11Protocol(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S
    max_pending = MAX_PENDING
    waiting = [0]  # connections of this process waiting for their headers (one event loop)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_timer = None
        self._phase = ""
        if self.waiting[0] >= self.max_pending:
            READ_TIMEOUTS.count("refused", self.client)
            transport.close()
            return
        self._arm("headers", self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if not self._phase and self.conn.their_state is h11.IDLE:  # a next request begins
            self._arm("headers", self.header_timeout_s)
        super().data_received(data)
        self._follow()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._phase == "headers":
            self._arm("body", self.body_timeout_s)
        elif state is not h11.IDLE and state is not h11.SEND_BODY:
            self._disarm()  # the request is whole (DONE), or the connection is ending

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self.waiting[0] += phase == "headers"
        self._read_timer = self.loop.call_later(seconds, self._expired, phase)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self.waiting[0] -= self._phase == "headers"
        self._read_timer, self._phase = None, ""

    def _expired(self, phase: str) -> None:
        self._read_timer = None
        self._disarm()
        if self.transport.is_closing():
            return
        READ_TIMEOUTS.count(phase, self.client)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()  # an app waiting for the body sees the client leave
        self.transport.close()
