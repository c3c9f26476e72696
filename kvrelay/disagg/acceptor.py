"""Decode's prefill peers: accepting their connections and decode's half of the handshake
(handshake.py: hello, challenge, proofs, then the layout check), which ends with the offer of
what the backend lets prefill use (cuda_ipc: decode's cache tensors; nixl: its NIXL agent's
metadata and page pools). A peer that fails any step
is told why, counted and hung up on. The receiver (receiver.py) builds on this: only
authenticated peers' messages reach its transfer state machine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvrelay.config import DisaggConfig
from kvrelay.disagg import handshake as H
from kvrelay.disagg import protocol as P
from kvrelay.disagg.agent import TransferAgent
from kvrelay.disagg.transport.base import Connection
from kvrelay.engine.pd_connector import SchedulerSide, WorkerSide

log = logging.getLogger("kvrelay.disagg")


@dataclass
class Handshake:
    """A connection whose prefill has said hello but not yet proved it holds the PD secret."""

    hello: P.Hello
    nonce: bytes = field(default_factory=H.new_nonce)  # ours, for this connection


class PrefillAcceptor(TransferAgent):
    """A decode agent's prefill connections until they prove they hold the PD secret."""

    def __init__(self, cfg: DisaggConfig, scheduler: SchedulerSide, worker: WorkerSide) -> None:
        super().__init__(cfg, scheduler, worker)
        self._handshakes: dict[Connection, Handshake] = {}  # said hello, not yet authenticated

    def _on_handshake(self, conn: Connection, msg: P.Hello | P.Auth | P.Failure) -> None:
        shake = self._handshakes.get(conn)
        if isinstance(msg, P.Hello):
            if shake is not None:
                raise ConnectionError(f"a second hello from {conn.peer}")
            self._handshakes[conn] = Handshake(msg)
            problem = self.hello_problem(msg)
            if problem is not None and problem[0] != P.Cause.LAYOUT:
                return self._refuse(conn, *problem)
            # The challenge: our nonce, nothing of our layout (prefill's fingerprint echoed;
            # ours is compared, and a difference named, once prefill has proved itself).
            challenge = P.Hello(
                self.instance_id, self.role, msg.layout, self._handshakes[conn].nonce
            )
            conn.send(P.encode(challenge))
            return
        if isinstance(msg, P.Failure):  # prefill refused us (and hangs up)
            log.warning(
                "prefill peer=%s refused the handshake cause=%s message=%s",
                conn.peer,
                msg.cause,
                msg.message,
            )
            raise ConnectionError(f"prefill refused the handshake: {msg.message}")
        if shake is None:
            raise ConnectionError(f"an auth before the hello from {conn.peer}")
        if not H.proof_ok(self._proof("prefill", shake, H.binding(msg.nixl)), msg.proof):
            why = f"prefill at {conn.peer} failed to prove it holds the PD secret"
            return self._refuse(conn, P.Cause.UNAUTHENTICATED, "peer_unauthenticated", why)
        del self._handshakes[conn]
        mismatch = self.layout_mismatch(shake.hello)
        if mismatch:
            return self._refuse(conn, P.Cause.LAYOUT, "layout_mismatch", mismatch)
        self._authenticated(conn)
        # Only now, to a peer that proved itself: where it may write (cuda_ipc: our tensors;
        # nixl: our agent's metadata and page pools, which our proof covers)
        offer = self.backend.offer(self.kinds, conn, msg)
        bound = H.binding(offer.get("nixl"))
        conn.send(P.encode(P.Auth(self._proof("decode", shake, bound), **offer)))
        # Prefill connects from a fresh port each time: a restart shows as peer_lost, then
        # peer_connected with a new instance id (prefill itself counts peer_restarted).
        self._connected_peer(conn)
        log.info("prefill connected peer=%s instance=%s", conn.peer, shake.hello.instance_id)

    def _proof(self, role: str, shake: Handshake, bound: bytes = b"") -> bytes:
        p = shake.hello
        return H.proof(
            self.secret, role, p.nonce, shake.nonce, p.instance_id, self.instance_id, bound
        )

    def _refuse(self, conn: Connection, cause: str, event: str, message: str) -> None:
        """Tell a peer why it is refused, log it, count it, hang up."""
        self._stranger_warn(  # one line per cause and second: the format names the cause
            f"transfer peer refused peer=%s cause={cause} message=%s", conn.peer, message
        )
        self._count_event(event)
        self._handshakes.pop(conn, None)
        try:
            conn.send(P.encode(P.Failure("", cause, message)))
        except ConnectionError:
            pass
        conn.close()
