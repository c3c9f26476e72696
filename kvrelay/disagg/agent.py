"""What the prefill sender and the decode receiver share: the transport, identity, events, failures.

An agent works through the PD connector's two sides (engine/pd_connector.py): the scheduler side
for requests and pages, the worker side for the caches; and through one transfer backend
(transport/base.py) for frames and for how a piece's bytes move. It never sees the engine.

Transport threads only decode frames (and verify checksums, which is pure CPU work) and queue events;
every state change happens on the engine thread in `poll()`, so the scheduler and the KV pool are
never touched from two threads. The handshake (handshake.py) runs on the transport threads too:
until a connection's peer has proved it holds the PD secret, any message but the handshake's
(a heartbeat too) closes the connection, and no frame may carry a payload; a peer is sent
heartbeats, and watched for silence, only once it has authenticated.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass

import msgspec

from kvrelay.config import DisaggConfig
from kvrelay.disagg import handshake as H
from kvrelay.disagg import protocol as P
from kvrelay.disagg.layout import (
    CacheKind,
    describe_layout,
    fingerprint,
    layout_difference,
    max_piece_bytes,
)
from kvrelay.disagg.transport import make_backend
from kvrelay.disagg.transport.base import Connection
from kvrelay.engine.messages import RequestOutput
from kvrelay.engine.pd_connector import SchedulerSide, WorkerSide

log = logging.getLogger("kvrelay.disagg")


@dataclass
class Event:
    conn: Connection
    msg: P.Message | None  # None: the connection closed
    payload: memoryview | None = None
    checksum_ok: bool = True
    reason: str = ""


def cache_layout(worker: WorkerSide) -> tuple[list[CacheKind], list[str]]:
    """The engine's cache kinds and their description (what both sides of a pair must share)."""
    kinds = worker.kinds
    return kinds, describe_layout(kinds, worker.page_size, worker.vocab_size)


class TransferAgent:
    role = ""

    def __init__(self, cfg: DisaggConfig, scheduler: SchedulerSide, worker: WorkerSide) -> None:
        self.sched, self.worker = scheduler, worker
        self.cfg = cfg
        # the backend's frames, and how a piece's bytes move (no other backend difference here)
        self.backend = make_backend(cfg.transfer_backend, cfg.checksum, worker.device)
        self.transport = self.backend.transport
        self.instance_id = uuid.uuid4().hex[:16]
        self.kinds, self.layout_lines = cache_layout(worker)
        self.kind_by_name = {k.name: k for k in self.kinds}
        self.layout = fingerprint(self.layout_lines)
        self.secret = self.cfg.pd_secret  # "": no peer can authenticate, every one is refused
        # What an authenticated peer's frame may carry: one piece of a whole-context prompt.
        self.max_payload = max_piece_bytes(self.kinds, worker.max_model_len)
        self._authed: set[Connection] = set()  # peers that completed the handshake
        self.events: queue.Queue[Event] = queue.Queue()
        self.addr = ""
        self.failure_counts: dict[str, int] = {}  # cause -> failed transfers since start
        # direction -> backend -> KV bytes since start (prefill: sent; decode: installed)
        self.direction = "sent" if self.role == "prefill" else "installed"
        self.byte_counts: dict[str, dict[str, int]] = {
            self.direction: {self.cfg.transfer_backend: 0}
        }
        # event -> count since start. Counted on transport and heartbeat threads too, hence the lock.
        self.bootstrap_counts: dict[str, int] = {}
        self._bootstrap_lock = threading.Lock()
        self._stranger_lines: dict[str, tuple[float, int]] = {}  # log line -> (last, unlogged)
        self._connected: set[Connection] = set()  # peers whose hello we accepted (-> peer_lost)
        self._timings: list[tuple[str, str, float]] = []  # finished transfers, not yet shipped
        # Liveness runs on its own thread: a peer whose process is alive but whose engine is busy in a
        # long forward still answers; a peer that went silent (host gone, network cut) is dropped.
        self._live: dict[Connection, float] = {}  # connection -> when it last sent us anything
        self._live_lock = threading.Lock()
        self._stop = threading.Event()
        self.heartbeats_paused = False  # test hook: stop sending, as a wedged host would
        threading.Thread(target=self._heartbeat_loop, daemon=True, name="kvrelay-heartbeat").start()

    def track(self, conn: Connection) -> None:
        with self._live_lock:
            self._live[conn] = time.monotonic()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_interval_s):
            now = time.monotonic()
            with self._live_lock:
                conns = list(self._live.items())
            for conn, seen in conns:
                if conn.closed:
                    with self._live_lock:
                        self._live.pop(conn, None)
                elif now - seen > self.cfg.heartbeat_timeout_s:
                    log.warning(
                        "peer silent, dropping it peer=%s silent_s=%.1f", conn.peer, now - seen
                    )
                    self._count_event("peer_silent")
                    conn.close()
                elif not self.heartbeats_paused:
                    try:
                        conn.send(P.encode(P.Heartbeat(self.instance_id, time.time())))
                    except ConnectionError:
                        pass

    # -- transport threads -------------------------------------------------------------------------

    def hello(self, nonce: bytes) -> bytes:
        return P.encode(
            P.Hello(self.instance_id, self.role, self.layout, nonce, description=self.layout_lines)
        )

    def hello_problem(self, peer: P.Hello) -> tuple[str, str, str] | None:
        """(cause, bootstrap event, message) when a peer's hello rules the pairing out."""
        if peer.version != P.PROTOCOL_VERSION:
            why = f"{peer.role} speaks PD protocol {peer.version}, {self.role} {P.PROTOCOL_VERSION}"
            return P.Cause.PROTOCOL, "protocol_mismatch", why
        if len(peer.nonce) != H.NONCE_BYTES:
            why = f"{peer.role}'s hello has a {len(peer.nonce)}-byte nonce, not {H.NONCE_BYTES}"
            return P.Cause.PROTOCOL, "protocol_mismatch", why
        if peer.role == self.role:
            return P.Cause.PROTOCOL, "protocol_mismatch", f"the peer is a {peer.role} too"
        if not self.secret:
            why = f"{self.role} has no PD secret (--pd-secret): it cannot authenticate any peer"
            return P.Cause.UNAUTHENTICATED, "peer_unauthenticated", why
        mismatch = self.layout_mismatch(peer)
        if mismatch:
            return P.Cause.LAYOUT, "layout_mismatch", mismatch
        return None

    def layout_mismatch(self, peer: P.Hello) -> str:
        """Why a peer's cache layout cannot pair with ours ("" when it can)."""
        if peer.layout == self.layout:
            return ""
        why = layout_difference(self.layout_lines, peer.description)
        return f"{peer.role} cache layout {peer.layout} differs from {self.role}'s {self.layout} ({why})"

    def _on_message(self, conn: Connection, header: bytes, payload: memoryview) -> None:
        if conn in self._authed:  # only a peer that proved itself is kept alive (and pinged)
            self.track(conn)
        try:
            msg = P.decode(header)
        except msgspec.DecodeError as e:  # ValidationError too: a field beyond its limits
            if conn in self._authed:
                log.warning("frame refused peer=%s cause=bad_message message=%s", conn.peer, e)
            else:
                self._count_event("stranger_bad_message")
                self._stranger_warn(
                    "frame refused peer=%s cause=bad_message message=%s", conn.peer, e
                )
            self._on_bad_message(conn, str(e))
            raise ConnectionError(f"undecodable frame header: {e}") from e
        if conn not in self._authed:
            if not isinstance(msg, P.Hello | P.Auth | P.Failure):  # heartbeats too
                self._stranger_warn(
                    "transfer peer refused peer=%s cause=%s message=%s before the handshake",
                    conn.peer,
                    P.Cause.UNAUTHENTICATED,
                    type(msg).__name__,
                )
                self._count_event("peer_unauthenticated")
                raise ConnectionError(f"{type(msg).__name__} before the handshake completed")
            self._on_handshake(conn, msg)
            if conn in self._authed:  # our own proof is sent: heartbeats may follow it now
                self.track(conn)
            return
        ok = self._arrived_ok(msg, payload, conn) if isinstance(msg, P.ChunkHeader) else True
        if isinstance(msg, P.Hello | P.Auth):
            raise ConnectionError(f"a second {type(msg).__name__} on an authenticated connection")
        self.events.put(Event(conn, msg, payload if payload.nbytes else None, ok))

    def _on_close(self, conn: Connection, reason: str) -> None:
        self.events.put(Event(conn, None, reason=reason))

    def _stranger_warn(self, fmt: str, *args) -> None:
        """A line about a peer that has not authenticated: one per message kind per second at
        most (a flood of strangers must not flood the log); the next says how many were left
        out. Every one is counted all the same (bootstrap events)."""
        now = time.monotonic()
        with self._bootstrap_lock:
            last, quiet = self._stranger_lines.get(fmt, (0.0, 0))
            if now - last < 1.0:
                self._stranger_lines[fmt] = (last, quiet + 1)
                return
            self._stranger_lines[fmt] = (now, 0)
        log.warning(fmt + " unlogged_since_last=%d", *args, quiet)

    def _on_handshake(self, conn: Connection, msg: P.Hello | P.Auth | P.Failure) -> None:
        """A handshake message from a peer not yet authenticated (on its transport thread)."""
        raise NotImplementedError

    def _arrived_ok(self, h: P.ChunkHeader, payload: memoryview, conn: Connection) -> bool:
        """A piece's frame, on the transport thread: whether its payload is whole and intact."""
        return True

    def _on_bad_message(self, conn: Connection, why: str) -> None:
        """A frame that is no valid message (the connection closes after this)."""

    def _authenticated(self, conn: Connection) -> None:
        self._authed.add(conn)
        conn.max_payload = self.max_payload if self.role == "decode" else 0  # prefill gets none
        conn.authenticated()  # the backend may now give it a reader of its own

    # -- engine thread -----------------------------------------------------------------------------

    def _send(self, conn: Connection | None, msg: P.Message, buffers=()) -> bool:
        if conn is None or conn.closed:
            return False
        try:
            conn.send(P.encode(msg), buffers)
            return True
        except ConnectionError:
            return False

    def _count_failure(self, cause: str) -> None:
        # Counted here, where it happens: the API may have dropped the request already (the router
        # cancelled it), and the failure must still show in /metrics.
        self.failure_counts[cause] = self.failure_counts.get(cause, 0) + 1

    def _count_event(self, event: str) -> None:
        """A bootstrap event: peer_connected, peer_restarted, peer_lost, peer_silent,
        layout_mismatch, handshake_timeout, connect_failed, ipc_open_failed,
        peer_unauthenticated, protocol_mismatch, stranger_bad_message (an undecodable frame before
        the handshake; and the listener's own: `listener_counts`)."""
        with self._bootstrap_lock:
            self.bootstrap_counts[event] = self.bootstrap_counts.get(event, 0) + 1

    def _connected_peer(self, conn: Connection) -> None:
        self._connected.add(conn)
        self._count_event("peer_connected")

    def _lost_peer(self, conn: Connection) -> None:
        self._authed.discard(conn)
        # Only peers that completed the handshake: a refused or timed-out hello is its own event.
        if conn in self._connected:
            self._connected.discard(conn)
            self._count_event("peer_lost")

    def _count_bytes(self, nbytes: int, backend: str) -> None:
        # By how the bytes moved: a cuda_ipc server paired with a tcp one sends through the socket.
        per_backend = self.byte_counts[self.direction]
        per_backend[backend] = per_backend.get(backend, 0) + nbytes

    def _observe(self, phase: str, seconds: float) -> None:
        self._timings.append((self.role, phase, seconds))

    def take_stats(self) -> tuple[dict[str, dict[str, int]], dict[str, int], list]:
        """Byte and bootstrap totals since start, and the timings of transfers finished since the
        last call (histogram samples can't be shipped as totals: each is handed over once)."""
        with self._bootstrap_lock:
            events = dict(self.bootstrap_counts)
        events.update(self.listener_counts())
        timings, self._timings = self._timings, []
        return {d: dict(b) for d, b in self.byte_counts.items()}, events, timings

    def listener_counts(self) -> dict[str, int]:
        """What the transfer listener refused or survived (strangers: stranger_refused,
        stranger_garbage, handshake_timeout; accept_failed and accept_shed when it ran out of
        descriptors), as bootstrap events; zeros left out."""
        counts = getattr(self.transport, "listener_counts", dict)()
        return {k: v for k, v in counts.items() if v and k != "accepted"}

    def _emit_failure(self, rid: str, tid: str, cause: str, message: str, state: str) -> None:
        self._count_failure(cause)
        log.warning(
            "transfer failed rid=%s transfer_id=%s role=%s state=%s cause=%s message=%s",
            rid,
            tid,
            self.role,
            state,
            cause,
            message,
        )
        self.sched.emit(
            RequestOutput(rid, [], finish_reason="error", error=f"{cause}: {message}", cause=cause)
        )

    def poll(self) -> None:
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                break
            if ev.msg is None:
                self._on_conn_lost(ev.conn, ev.reason)
            else:
                self._handle(ev)
        self._check_deadlines()

    def on_sampled(self, req, out: RequestOutput) -> bool:
        """A request's sampled token (prefill ships its KV with the first); True: it was ours."""
        return False

    def reject(self, transfer_id: str, reason: str) -> None:
        """The engine refused this side's copy of a PD request (bad input): tell the peer if it asks."""

    def _handle(self, ev: Event) -> None:
        raise NotImplementedError

    def _on_conn_lost(self, conn: Connection, reason: str) -> None:
        raise NotImplementedError

    def _check_deadlines(self) -> None:
        raise NotImplementedError

    @property
    def in_flight(self) -> bool:
        raise NotImplementedError

    def state_counts(self) -> dict[str, int]:
        """Transfers per state (every state this side has, zeros included): the per-state gauges."""
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        self.transport.close()
        self.backend.close()
