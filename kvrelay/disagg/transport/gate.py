"""The transfer listener's front gate: one thread accepts every connection and carries it
through the handshake; only a peer that authenticated gets a reader thread of its own.

What a stranger (any process that can reach the port) can cost is bounded here:
- at most `max_pending` connections wait for their handshake at once; past that a new one is
  accepted and closed at once (counted `stranger_refused`): the listener never stops accepting;
- each has `handshake_deadline_s` from its accept to prove itself, else it is closed
  (`handshake_timeout`); a frame that is not one (bad magic, a header over `max_header`, any
  payload) closes it too (`stranger_garbage`);
- no thread per connection: one selector; frames are buffered here until whole (at most one
  prefix + `max_header` bytes per connection) and handed to `on_message` in order;
- accept() failing for want of descriptors (EMFILE, ENFILE, ENOBUFS, ENOMEM) is logged, counted
  (`accept_failed`), and survived: a spare descriptor is given up to accept and close the
  connection that waits (`accept_shed`: the peer sees a close, not a full backlog), and the
  listener is paused with a growing backoff (0.05 s to 1 s) and then resumes by itself.
`on_message` (the agent's handshake) runs on this thread; a connection it authenticates
(`Connection.authenticated()`) leaves the gate with its buffered bytes for a reader thread.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvrelay.disagg.tcp")

FD_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
BACKOFF_S = (0.05, 1.0)  # first and longest pause of the listener after an accept failure
SEND_TIMEOUT_S = 2.0  # a handshake frame the peer does not take within this closes it


class Pending:
    """A connection in the gate: its socket, buffered bytes and deadline."""

    def __init__(self, conn, fd: int, deadline: float) -> None:
        self.conn, self.fd = conn, fd
        self.buf = bytearray()
        self.deadline = deadline


class Gate:
    def __init__(
        self,
        srv: socket.socket,
        make_conn: Callable[[socket.socket, str], object],
        parse: Callable[[bytearray], tuple[bytes, int] | None],
        max_pending: int,
        handshake_deadline_s: float,
        max_buffer: int,
    ) -> None:
        """`make_conn(sock, peer)`: a connection not reading yet; `parse(buf)`: (header, frame
        length) of the first whole frame, None while incomplete; raises ConnectionError."""
        self.srv, self.make_conn, self.parse = srv, make_conn, parse
        self.max_pending = max_pending
        self.handshake_deadline_s = handshake_deadline_s
        self.max_buffer = max_buffer
        self.counts: dict[str, int] = {}
        self._logged: dict[str, tuple[float, int]] = {}  # event -> (last line's time, unlogged)
        self._counts_lock = threading.Lock()
        self._pending: dict[int, Pending] = {}  # fileno -> connection in the handshake
        self._sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._spare: int | None = _spare_fd()
        self._paused_until = 0.0
        self._backoff = BACKOFF_S[0]
        srv.setblocking(False)
        self._sel.register(srv, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvrelay-tcp-gate")
        self._thread.start()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def count(self, event: str) -> None:
        with self._counts_lock:
            self.counts[event] = self.counts.get(event, 0) + 1

    def _warn(self, event: str, fmt: str, *args) -> None:
        """One line per event kind per second at most (a flood must not flood the log); the
        next line says how many were left out."""
        now = time.monotonic()
        last, quiet = self._logged.get(event, (0.0, 0))
        if now - last < 1.0:
            self._logged[event] = (last, quiet + 1)
            return
        self._logged[event] = (now, 0)
        log.warning(fmt + " unlogged_since_last=%d", *args, quiet)

    def take_counts(self) -> dict[str, int]:
        with self._counts_lock:
            return dict(self.counts)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # -- the gate thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._resume_if_due()
                for key, _ in self._sel.select(self._wait_s()):
                    if key.data is None:
                        self._accept_all()
                    else:
                        self._readable(key.data)
                self._expire()
        except Exception:  # a bug here must not leave the port dead and silent
            log.exception("transfer listener gate failed")
        finally:
            for p in list(self._pending.values()):
                self._drop(p, "listener closed")
            self._sel.close()
            if self._spare is not None:
                os.close(self._spare)

    def _wait_s(self) -> float:
        now = time.monotonic()
        due = [p.deadline for p in self._pending.values()]
        if self._paused_until:
            due.append(self._paused_until)
        return max(0.0, min([now + 0.2, *due]) - now)

    def _accept_all(self) -> None:
        while True:
            try:
                sock, addr = self.srv.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in FD_ERRORS:
                    return self._out_of_descriptors(e)
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    continue
                if self._stop.is_set() or self.srv.fileno() < 0:
                    return
                log.warning("transfer listener accept error=%s", e)
                self.count("accept_failed")
                return self._pause()
            self._backoff = BACKOFF_S[0]
            peer = f"{addr[0]}:{addr[1]}"
            if len(self._pending) >= self.max_pending:
                self.count("stranger_refused")
                self._warn(
                    "stranger_refused",
                    "transfer peer refused peer=%s cause=stranger_refused pending=%d",
                    peer,
                    len(self._pending),
                )
                _close_at_once(sock)
                continue
            self._admit(sock, peer)

    def _admit(self, sock: socket.socket, peer: str) -> None:
        sock.settimeout(SEND_TIMEOUT_S)  # non-blocking for select; a send waits at most this
        conn = self.make_conn(sock, peer)
        p = Pending(conn, sock.fileno(), time.monotonic() + self.handshake_deadline_s)
        self._pending[p.fd] = p
        self._sel.register(sock, selectors.EVENT_READ, p)
        self.count("accepted")

    def _out_of_descriptors(self, e: OSError) -> None:
        self.count("accept_failed")
        self._warn(
            "accept_failed",
            "transfer listener out of descriptors error=%s pending=%d backoff_s=%.2f",
            e.strerror,
            len(self._pending),
            self._backoff,
        )
        if self._spare is not None:  # one descriptor to take the waiting peer off the backlog
            os.close(self._spare)
            self._spare = None
            try:
                sock, _ = self.srv.accept()
                _close_at_once(sock)
                self.count("accept_shed")
            except OSError:
                pass
            self._spare = _spare_fd()
        self._pause()

    def _pause(self) -> None:
        self._sel.unregister(self.srv)
        self._paused_until = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_S[1])

    def _resume_if_due(self) -> None:
        if self._paused_until and time.monotonic() >= self._paused_until:
            self._paused_until = 0.0
            if self._spare is None:
                self._spare = _spare_fd()
            self._sel.register(self.srv, selectors.EVENT_READ, None)

    def _readable(self, p: Pending) -> None:
        try:
            chunk = p.conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            return self._drop(p, str(e))
        if not chunk:
            return self._drop(p, "peer closed the connection")
        p.buf += chunk
        while True:
            try:
                frame = self.parse(p.buf)
            except ConnectionError as e:  # tcp.FramingError: names its cause
                cause = getattr(e, "cause", "bad_frame")
                self._warn(
                    "garbage", "frame refused peer=%s cause=%s message=%s", p.conn.peer, cause, e
                )
                self.count("stranger_garbage")
                return self._drop(p, str(e))
            if frame is None:
                if len(p.buf) > self.max_buffer:  # cannot happen with parse's limits; a guard
                    self.count("stranger_garbage")
                    return self._drop(p, "handshake frame too large")
                return
            header, n = frame
            del p.buf[:n]
            try:
                p.conn.deliver(header)
            except Exception as e:  # the handshake refused it (or a bug): hang up
                return self._drop(p, str(e) or type(e).__name__)
            if p.conn.closed:
                return self._forget(p)
            if p.conn.is_authenticated:
                self._forget(p)
                p.conn.start_reading(bytes(p.buf))
                return

    def _expire(self) -> None:
        now = time.monotonic()
        for p in [p for p in self._pending.values() if p.deadline <= now]:
            self._warn(
                "handshake_timeout",
                "transfer peer dropped peer=%s cause=handshake_timeout deadline_s=%.1f",
                p.conn.peer,
                self.handshake_deadline_s,
            )
            self.count("handshake_timeout")
            self._drop(p, f"no handshake within {self.handshake_deadline_s:g}s")

    def _forget(self, p: Pending) -> None:
        if self._pending.get(p.fd) is p:
            del self._pending[p.fd]
            try:
                self._sel.unregister(p.fd)
            except (KeyError, ValueError):
                pass

    def _drop(self, p: Pending, reason: str) -> None:
        self._forget(p)
        p.conn.shutdown(reason)


def _spare_fd() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None


def _close_at_once(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
