"""Prefill side: reserve on decode, compute the prompt, send its caches chunk by chunk + first token.

Per request: BOOTSTRAPPING (ReserveRequest sent) -> PREFILLING (decode holds pages; the request is
in the local scheduler; the paged cache rows each prompt chunk completed go out, per layer group,
right after the step that computed it, except those of the prefix decode's ack says it holds
already) -> SENDING (the last chunk, the per-request state after the prompt and the first token
sent, pages and slot freed here; waiting for decode's TransferDone) ->
DONE; any state -> FAILED with a cause, a log line and an error output. A Failure from decode is
answered with Released once nothing more will be sent or written for that transfer: decode keeps
the pages it gave us fenced until then. A decode address without a live peer is dialed on a
thread of its own (dialer.py); its transfers wait in BOOTSTRAPPING, under their bootstrap
deadline, and are bootstrapped here once the dial is adopted on the engine thread.

How a piece's bytes reach decode is the peer's `PieceLink` (transport/base.py: framed over tcp,
or written into decode's pages over cuda_ipc), chosen at the handshake; nothing here depends on
the backend. Test faults (faults.py) come in through one optional hook, `faults`.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

import msgspec

from kvrelay.cache.paging import pages_for
from kvrelay.config import DisaggConfig
from kvrelay.disagg import protocol as P
from kvrelay.disagg.agent import Event
from kvrelay.disagg.dialer import DecodeDialer, Peer, PeerRefused
from kvrelay.disagg.faults import SendFaults
from kvrelay.disagg.layout import PAGE, SLOT, layer_groups
from kvrelay.disagg.protocol import TState
from kvrelay.disagg.transport.base import Connection, Piece, PieceFault
from kvrelay.engine.messages import RequestOutput
from kvrelay.engine.pd_connector import SchedulerSide, WorkerSide

log = logging.getLogger("kvrelay.disagg")


@dataclass
class PrefillTransfer:
    req: object
    pd: P.PDParams
    sm: P.TransferStateMachine
    peer: Peer | None = None
    first: RequestOutput | None = None
    sent: int = 0  # prompt tokens whose KV went to decode
    pieces: int = 0  # KV pieces sent
    dst_pages: list[int] = field(default_factory=list)  # decode's, from its reservation ack
    dst_slot: int = 0
    skip: int = 0  # prompt tokens whose paged KV decode holds already (its ack): never sent
    resume_rows: bool = (
        False  # decode caches the prompt's pages (its ack): window rows a hit reads go
    )
    fault: PieceFault | None = None  # TEST ONLY (faults.py): damage to one of its pieces
    acked: float = 0.0  # monotonic time of decode's reservation ack
    send_s: float = 0.0  # time spent sending pieces (gather, checksum, copy or socket)


class PrefillSender(DecodeDialer):
    role = "prefill"

    def __init__(
        self, cfg: DisaggConfig, scheduler: SchedulerSide, worker: WorkerSide,
        faults: SendFaults | None = None,
    ) -> None:  # fmt: skip
        super().__init__(cfg, scheduler, worker)
        self.transfers: dict[str, PrefillTransfer] = {}  # by rid
        self.page_groups = layer_groups(self.kinds, PAGE, self.cfg.layers_per_chunk)
        self.slot_groups = layer_groups(self.kinds, SLOT, self.cfg.layers_per_chunk)
        self.faults = faults  # TEST ONLY (faults.py): None unless a test or a test flag sets one

    def state_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(("bootstrapping", "prefilling", "sending"), 0)
        for t in self.transfers.values():
            counts[t.sm.state.value] += 1
        return counts

    def _send(self, conn: Connection | None, msg: P.Message, buffers=()) -> bool:
        if self.faults is not None and self.faults.delays(msg):  # TEST ONLY: a stalled link
            return self.faults.send_late(conn, msg, buffers)
        return super()._send(conn, msg, buffers)

    @property
    def in_flight(self) -> bool:
        return bool(self.transfers) or not self.events.empty() or not self._dialed.empty()

    def _skip_problem(self, t: PrefillTransfer, ack: P.ReserveAck) -> str:
        """Decode may skip only whole pages of the prompt, never its last token (a piece must
        start where a page does, and decode needs at least the rows after its cached prefix).
        Per-request state (DeepSeek-V4's compressor slot) is sent for the whole prompt anyway:
        decode continues from it, its cached pages only spare the paged rows."""
        n, page = len(t.req.prompt_ids), self.worker.page_size
        skip = ack.skip_tokens
        if skip and (skip >= n or skip % page):
            return (
                f"decode asks to skip {skip} tokens of a {n}-token prompt (pages of {page} tokens)"
            )
        return ""

    def _destination_problem(self, t: PrefillTransfer, ack: P.ReserveAck) -> str:
        """A link that writes into decode's memory checks where decode's ack says they land."""
        need = pages_for(len(t.req.prompt_ids), self.worker.page_size)
        return t.peer.link.destination_problem(ack.pages, ack.slot, need)

    def _adopt_dials(self) -> None:
        """Engine thread: dials that ended make their peers current and bootstrap the transfers
        waiting for them, or fail those with the dial's cause."""
        while True:
            try:
                addr, result = self._dialed.get_nowait()
            except queue.Empty:
                return
            waiting = [self.transfers.get(rid) for rid in self._waiting.pop(addr, [])]
            waiting = [t for t in waiting if t is not None and not t.sm.final]
            if isinstance(result, PeerRefused):
                for t in waiting:
                    self._fail(t, result.cause, str(result), notify=False)
                continue
            self.peers[addr] = result
            self._connected_peer(result.conn)
            before = self.instance_at.get(addr)
            if before is not None and before != result.instance_id:
                self._count_event("peer_restarted")  # its old sessions died with the old connection
            self.instance_at[addr] = result.instance_id
            log.info("connected to decode addr=%s instance=%s", addr, result.instance_id)
            for t in waiting:
                self._bootstrap(t, result)

    # -- engine hooks --------------------------------------------------------------------------------

    def add(self, req, pd: P.PDParams) -> None:
        c = self.cfg
        t = PrefillTransfer(
            req,
            pd,
            P.prefill_machine(c.bootstrap_timeout_s, c.transfer_timeout_s, c.bootstrap_timeout_s),
        )
        if self.faults is not None:  # TEST ONLY
            t.fault = self.faults.piece_fault()
        self.transfers[req.rid] = t
        addr = pd.decode_addr
        peer = self.peers.get(addr)
        if peer is not None and not peer.conn.closed:
            return self._bootstrap(t, peer)
        # No live peer: dial on a thread (the engine keeps stepping meanwhile); the transfer's
        # bootstrap deadline runs from now.
        if addr not in self._waiting:
            self._waiting[addr] = []
            self._start_dial(addr)
        self._waiting[addr].append(req.rid)

    def _bootstrap(self, t: PrefillTransfer, peer: Peer) -> None:
        """Ask decode (a live, authenticated peer) to reserve KV for this transfer."""
        t.peer, pd, req = peer, t.pd, t.req
        if pd.decode_instance and t.peer.instance_id != pd.decode_instance:
            return self._fail(
                t,
                P.Cause.PEER_FAILED,
                f"decode at {pd.decode_addr} restarted (instance "
                f"{t.peer.instance_id}, router expected {pd.decode_instance})",
                notify=False,
            )
        rr = P.ReserveRequest(
            pd.transfer_id, req.rid, len(req.prompt_ids), P.prompt_hash(req.prompt_ids)
        )
        if not self._send(t.peer.conn, rr):
            self._fail(
                t, P.Cause.PEER_LOST, "connection to decode lost while bootstrapping", notify=False
            )

    def on_sampled(self, req, out: RequestOutput) -> bool:
        """After the prompt's last chunk: ship KV + first token; True when the request was ours."""
        t = self.transfers.get(req.rid)
        if t is None or t.req is not req:
            return False
        try:
            t.sm.to(TState.SENDING)
            self._send_kv(t, len(req.prompt_ids))
            self._send_state(t)  # before finish() below frees the slot
            first = P.FirstToken(
                t.pd.transfer_id,
                req.rid,
                out.token_ids[0],
                out.logprobs[0] if out.logprobs else None,
                [(a.token_id, a.logprob) for a in out.top_logprobs[0]]
                if out.top_logprobs
                else None,
                t.pieces,
                out.num_cached_tokens,
            )
            if not self._send(t.peer.conn, first):
                raise ConnectionError("connection to decode lost while sending")
        except ConnectionError as e:
            self._fail(t, P.Cause.PEER_LOST, str(e), notify=False)
        finally:
            self.sched.finish(req, "transferred")  # pages are copied out (or useless)
        t.first = out
        return True

    def poll(self) -> None:
        self._adopt_dials()
        super().poll()
        # Ship the KV of the prompt chunks the last step computed, before the next step runs.
        for t in list(self.transfers.values()):
            if t.sm.state == TState.PREFILLING and t.req.num_computed > t.sent:
                try:
                    self._send_kv(t, t.req.num_computed)
                except ConnectionError as e:
                    self._fail(t, P.Cause.PEER_LOST, str(e), notify=False)

    def _send_kv(self, t: PrefillTransfer, end: int) -> None:
        """Send what prompt tokens [t.sent, end) filled in the paged kinds, per layer group."""
        if end <= t.sent:
            return
        for kinds in self.page_groups:
            self._send_piece(t, kinds, t.sent, end)
        t.sent = end

    def _send_state(self, t: PrefillTransfer) -> None:
        """Send the per-request state after the whole prompt (models that keep one)."""
        for kinds in self.slot_groups:
            self._send_piece(t, kinds, 0, len(t.req.prompt_ids))

    def _send_piece(self, t: PrefillTransfer, kinds: list, start: int, end: int) -> None:
        """Move the rows through the peer's link, then send the header that names them."""
        if t.peer.conn.closed:  # an in-place write could land in pages decode gave away since
            raise ConnectionError("connection to decode lost while sending KV")
        req, link = t.req, t.peer.link
        began = time.monotonic()
        piece = Piece(
            kinds, start, end, len(req.prompt_ids), t.resume_rows, req.pages, req.state_slot,
            t.dst_pages, t.dst_slot, t.pd.transfer_id,
        )  # fmt: skip
        moved = link.move(piece, t.fault)
        hdr = P.ChunkHeader(
            t.pd.transfer_id, req.rid, [k.name for k in kinds], start, end, moved.nbytes,
            moved.checksum, in_place=link.in_place,
        )  # fmt: skip
        if not self._send(t.peer.conn, hdr, moved.buffers):
            raise ConnectionError("connection to decode lost while sending KV")
        t.pieces += 1
        t.send_s += time.monotonic() - began
        self._count_bytes(moved.nbytes, link.name)

    def abort(self, rid: str) -> bool:
        t = self.transfers.pop(rid, None)
        if t is None:
            return False
        self._count_failure(P.Cause.ABORTED)
        if t.peer is not None:
            self._send(
                t.peer.conn, P.Failure(t.pd.transfer_id, P.Cause.ABORTED, "aborted on prefill")
            )
        log.info(
            "transfer aborted rid=%s transfer_id=%s state=%s",
            rid,
            t.pd.transfer_id,
            t.sm.state.value,
        )
        return True

    # -- events --------------------------------------------------------------------------------------

    def _by_tid(self, tid: str) -> PrefillTransfer | None:
        for t in self.transfers.values():
            if t.pd.transfer_id == tid:
                return t
        return None

    def _handle(self, ev: Event) -> None:
        msg = ev.msg
        if isinstance(msg, P.Heartbeat):
            return
        t = self._by_tid(getattr(msg, "transfer_id", ""))
        if t is None or t.peer is None or t.peer.conn is not ev.conn:
            log.info(
                "message for unknown transfer dropped type=%s transfer_id=%s",
                type(msg).__name__,
                getattr(msg, "transfer_id", ""),
            )
            if isinstance(msg, P.Failure) and msg.transfer_id:
                self._send(ev.conn, P.Released(msg.transfer_id))  # ended here: nothing more comes
            return
        if isinstance(msg, P.ReserveAck):
            if t.sm.state != TState.BOOTSTRAPPING:
                return self._fail(
                    t, P.Cause.IDENTITY, f"unexpected reservation ack in state {t.sm.state.value}"
                )
            if not msg.ok:
                return self._fail(
                    t,
                    P.Cause.REFUSED,
                    f"decode refused the reservation: {msg.reason}",
                    notify=False,
                )
            problem = self._skip_problem(t, msg) or self._destination_problem(t, msg)
            if problem:
                return self._fail(t, P.Cause.IDENTITY, problem)
            t.dst_pages, t.dst_slot = msg.pages, msg.slot
            t.skip = t.sent = msg.skip_tokens
            t.resume_rows = msg.resume_rows
            t.acked = time.monotonic()
            t.sm.to(TState.PREFILLING)
            self.sched.admit(t.req)
        elif isinstance(msg, P.TransferDone):
            if t.sm.state != TState.SENDING:
                return self._fail(
                    t, P.Cause.IDENTITY, f"unexpected transfer-done in state {t.sm.state.value}"
                )
            t.sm.to(TState.DONE)
            del self.transfers[t.req.rid]
            self._observe("transfer", time.monotonic() - t.acked)  # ack -> decode installed all
            self._observe("send", t.send_s)
            out = msgspec.structs.replace(t.first, finish_reason="transferred")
            self.sched.emit(out)
            log.debug("transfer done rid=%s transfer_id=%s", t.req.rid, t.pd.transfer_id)
        elif isinstance(msg, P.Failure):
            self._fail(
                t,
                msg.cause if msg.cause != P.Cause.ABORTED else P.Cause.PEER_FAILED,
                f"decode reported: {msg.message}",
                notify=False,
            )
            self._send(ev.conn, P.Released(msg.transfer_id))  # failed here: nothing more comes

    def _fail(self, t: PrefillTransfer, cause: str, message: str, notify: bool = True) -> None:
        state = t.sm.state.value
        if t.sm.state == TState.PREFILLING:  # only then is it in the scheduler, holding pages
            self.sched.finish(t.req, "error")
        if not t.sm.final:
            t.sm.to(TState.FAILED)
        self.transfers.pop(t.req.rid, None)
        if notify and t.peer is not None:
            self._send(t.peer.conn, P.Failure(t.pd.transfer_id, cause, message))
        self._emit_failure(t.req.rid, t.pd.transfer_id, cause, message, state)

    def _on_conn_lost(self, conn: Connection, reason: str) -> None:
        self._lost_peer(conn)
        for addr, peer in list(self.peers.items()):
            if peer.conn is conn:
                del self.peers[addr]
                if peer.link is not None:
                    peer.link.close()  # nixl: forget decode's agent
        for t in list(self.transfers.values()):
            if t.peer is not None and t.peer.conn is conn:
                self._fail(
                    t, P.Cause.PEER_LOST, f"connection to decode lost: {reason}", notify=False
                )

    def _check_deadlines(self) -> None:
        for t in list(self.transfers.values()):
            if t.sm.expired():
                self._fail(
                    t,
                    P.Cause.TIMEOUT,
                    f"no progress for {t.sm.timeouts_s[t.sm.state]:.0f}s "
                    f"in state {t.sm.state.value}",
                )
