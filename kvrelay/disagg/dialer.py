"""Prefill's decode peers: dialing (connect + handshake, each with its own deadline, on a thread
of its own, so a slow or silent decode never stalls the engine) and the prefill half of the
handshake (handshake.py), which ends with the peer's `PieceLink`: how pieces reach it, made by
the backend from what decode offered (cuda_ipc: its cache tensors). The sender (sender.py)
builds on this and adopts finished dials on the engine thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

from kvrelay.config import DisaggConfig
from kvrelay.disagg import handshake as H
from kvrelay.disagg import protocol as P
from kvrelay.disagg.agent import TransferAgent
from kvrelay.disagg.transport.base import Connection, LinkError, PieceLink
from kvrelay.engine.pd_connector import SchedulerSide, WorkerSide

log = logging.getLogger("kvrelay.disagg")

# Causes a decode may give for refusing our handshake (anything else counts as peer_failed).
_HANDSHAKE_CAUSES = {P.Cause.UNAUTHENTICATED, P.Cause.PROTOCOL, P.Cause.LAYOUT}


class PeerRefused(Exception):
    """No usable connection to a decode peer; `cause` is the failure cause (protocol.Cause)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass
class Peer:
    conn: Connection
    nonce: bytes = field(default_factory=H.new_nonce)  # ours, for this connection
    ready: threading.Event = field(default_factory=threading.Event)  # handshake over (or failed)
    instance_id: str = ""
    decode_nonce: bytes = b""
    cause: str = ""  # why the handshake failed ("" while it has not)
    error: str = ""
    event: str = ""  # the bootstrap event `error` counts as
    link: PieceLink | None = None  # how pieces reach this peer (set once it authenticated)


class DecodeDialer(TransferAgent):
    """A prefill agent's peers: authenticated connections by decode address, and dials."""

    def __init__(self, cfg: DisaggConfig, scheduler: SchedulerSide, worker: WorkerSide) -> None:
        super().__init__(cfg, scheduler, worker)
        self.peers: dict[str, Peer] = {}  # by decode address: authenticated connections
        self._handshakes: dict[Connection, Peer] = {}  # connections still shaking hands
        # Dialing runs on its own threads, never the engine thread: decode address -> the rids
        # waiting for it (engine thread only), and the dials' results for poll() to adopt.
        self._waiting: dict[str, list[str]] = {}
        self._dialed: queue.Queue[tuple[str, Peer | PeerRefused]] = queue.Queue()
        self.instance_at: dict[str, str] = {}  # decode address -> the instance last seen there

    def _on_handshake(self, conn: Connection, msg: P.Hello | P.Auth | P.Failure) -> None:
        peer = self._handshakes.get(conn)
        if peer is None or peer.ready.is_set():
            raise ConnectionError(f"unexpected {type(msg).__name__} from {conn.peer}")
        if isinstance(msg, P.Failure):  # decode refused us
            cause = msg.cause if msg.cause in _HANDSHAKE_CAUSES else P.Cause.PEER_FAILED
            return self._handshake_failed(peer, cause, f"decode refused: {msg.message}")
        if isinstance(msg, P.Hello):
            if peer.decode_nonce:
                raise ConnectionError(f"a second hello from {conn.peer}")
            peer.instance_id, peer.decode_nonce = msg.instance_id, msg.nonce
            problem = self.hello_problem(msg)
            if problem:
                return self._handshake_failed(peer, problem[0], problem[2], problem[1])
            me = self.backend.introduce()  # nixl: our agent's name, which our proof covers
            mine = self._proof("prefill", peer, H.binding(me))
            conn.send(P.encode(P.Auth(mine, nixl=me)))
            return
        if not peer.decode_nonce:
            raise ConnectionError(f"an auth before the hello from {conn.peer}")
        if not H.proof_ok(self._proof("decode", peer, H.binding(msg.nixl)), msg.proof):
            why = f"decode at {conn.peer} failed to prove it holds the PD secret"
            return self._handshake_failed(peer, P.Cause.UNAUTHENTICATED, why)
        try:  # what decode offers (cuda_ipc: its cache tensors; nixl: its agent) makes the link
            peer.link = self.backend.link(msg, self.worker)
        except LinkError as e:
            return self._handshake_failed(peer, P.Cause.IPC, str(e))
        self._authenticated(conn)
        peer.ready.set()

    def _proof(self, role: str, peer: Peer, bound: bytes = b"") -> bytes:
        return H.proof(
            self.secret, role, peer.nonce, peer.decode_nonce, self.instance_id, peer.instance_id,
            bound,
        )  # fmt: skip

    def _on_bad_message(self, conn: Connection, why: str) -> None:
        peer = self._handshakes.get(conn)
        if peer is not None and not peer.ready.is_set():
            why = f"decode at {conn.peer} sent an invalid handshake message: {why}"
            self._handshake_failed(peer, P.Cause.PROTOCOL, why)

    def _on_close(self, conn: Connection, reason: str) -> None:
        peer = self._handshakes.get(conn)
        if peer is not None and not peer.ready.is_set():  # wake `_peer` now, not at its timeout
            why = f"decode at {conn.peer} closed the connection during the handshake: {reason}"
            self._handshake_failed(peer, P.Cause.CONNECT, why, "connect_failed")
        super()._on_close(conn, reason)

    def _handshake_failed(self, peer: Peer, cause: str, message: str, event: str = "") -> None:
        peer.cause, peer.error = cause, message
        peer.event = event or {
            P.Cause.UNAUTHENTICATED: "peer_unauthenticated",
            P.Cause.IPC: "ipc_open_failed",
            P.Cause.LAYOUT: "layout_mismatch",
            P.Cause.PROTOCOL: "protocol_mismatch",
        }.get(cause, "handshake_failed")
        log.warning(
            "transfer peer refused peer=%s cause=%s message=%s", peer.conn.peer, cause, message
        )
        peer.ready.set()

    def _dial(self, addr: str) -> Peer:
        """Connect to the decode at `addr` and shake hands. Blocking (connect and handshake each
        up to connect_timeout_s), so it runs on a dial thread; the peer once it proved itself,
        or PeerRefused with the cause."""
        try:
            conn = self.transport.connect(
                addr, self._on_message, self._on_close, self.cfg.connect_timeout_s
            )
        except (OSError, ConnectionError) as e:
            self._count_event("connect_failed")
            raise PeerRefused(P.Cause.CONNECT, f"cannot reach decode at {addr}: {e}") from None
        peer = Peer(conn)
        self._handshakes[conn] = peer
        # Not tracked yet: a heartbeat before decode has authenticated us is refused (and hangs
        # up). The handshake has its own deadline; heartbeats start once decode proved itself.
        try:
            conn.send(self.hello(peer.nonce))
            if not peer.ready.wait(self.cfg.connect_timeout_s):
                self._count_event("handshake_timeout")
                raise PeerRefused(
                    P.Cause.CONNECT,
                    f"decode at {addr} did not complete the handshake within "
                    f"{self.cfg.connect_timeout_s}s",
                )
        except ConnectionError as e:
            self._count_event("connect_failed")
            raise PeerRefused(P.Cause.CONNECT, f"decode at {addr} hung up: {e}") from None
        finally:
            del self._handshakes[conn]
            if not peer.ready.is_set() or peer.error:
                conn.close()
        if peer.error:
            self._count_event(peer.event)
            raise PeerRefused(peer.cause, peer.error)
        return peer

    def _start_dial(self, addr: str) -> None:
        def run() -> None:
            try:
                result: Peer | PeerRefused = self._dial(addr)
            except PeerRefused as e:
                result = e
            except Exception as e:  # a bug here must still end the transfers that wait
                log.exception("dialing decode failed addr=%s", addr)
                result = PeerRefused(P.Cause.CONNECT, f"dialing decode at {addr} failed: {e!r}")
            self._dialed.put((addr, result))

        threading.Thread(target=run, name=f"pd-dial-{addr}", daemon=True).start()
