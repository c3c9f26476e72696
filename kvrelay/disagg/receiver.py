"""Decode side: reserve pages (and a state slot), check every piece against the reservation,
install it, then decode.

Per request: RESERVED (the scheduler holds pages and, for models with per-request state, a state
slot; with a prefix cache it shares, locked, the pages of the prompt's longest cached prefix, and
the ack tells prefill to skip their tokens and, since the prompt's pages enter the cache, to send
the window rows (and page-end state) a later hit at the prompt's last full page boundary reads
too (a hit never ends on the pages before it: radix.py); waiting for prefill's ReserveRequest)
-> RECEIVING (matched; pieces arriving as prefill computes the prompt chunk by chunk, each
checked: transfer id, request id, connection, cache kinds, token range (continuing where each
kind's rows end: the first page piece where the cached prefix ends), size, checksum) -> DONE (installed; the
scheduler admits the request with num_computed = prompt length and the first token appended);
any state -> FAILED (prefill told, error output). A ReserveRequest that arrives before decode's own
copy of the request waits as an orphan until that copy arrives or its deadline passes.

The fence: once prefill knows a reservation's pages (RECEIVING), a transfer that fails here keeps
its pages and slot out of the pool until prefill says it stopped writing (its Released, or its own
Failure) or its connection is closed: with an in-place backend (cuda_ipc) prefill writes straight
into those pages, and a late write must never land in the next owner's KV. A peer that does not
answer within bootstrap_timeout_s is hung up on, which lifts the fence.

A prefill's connection is authenticated before any of this (acceptor.py: decode's half of the
handshake); the receiver builds on that and listens for prefills once it is set up.

Only the PD connector's scheduler side touches pages and slots (reserve, admit_transferred,
finish, finish_fenced, release: the scheduler's public operations). How a piece's bytes came, and
so how they are checked and installed, is the backend's `PieceIntake` for the header's way
(transport/base.py: framed over tcp, already in place over cuda_ipc); nothing here depends on
the backend.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvrelay.cache.block_pool import OutOfPages
from kvrelay.config import DisaggConfig
from kvrelay.disagg import protocol as P
from kvrelay.disagg.acceptor import PrefillAcceptor
from kvrelay.disagg.agent import Event
from kvrelay.disagg.layout import PAGE, SLOT
from kvrelay.disagg.protocol import TState
from kvrelay.disagg.transport.base import Connection
from kvrelay.engine.kv_pieces import expected_bytes, piece_rows
from kvrelay.engine.messages import RequestOutput, TokenLogprob
from kvrelay.engine.pd_connector import SchedulerSide, WorkerSide
from kvrelay.engine.scheduler import Fence

log = logging.getLogger("kvrelay.disagg")


@dataclass
class DecodeTransfer:
    req: object
    pd: P.PDParams
    sm: P.TransferStateMachine
    conn: Connection | None = None
    filled: dict[str, int] = field(default_factory=dict)  # per cache kind: prompt tokens installed
    # the prompt's pages go to decode's prefix cache: the rows a hit at its last full page reads
    # must arrive too
    resume_rows: bool = False
    num_chunks: int = 0
    reserved: float = field(default_factory=time.monotonic)  # when decode reserved its pages
    install_s: float = 0.0  # time spent checking and installing pieces


@dataclass
class Fenced:
    """A failed transfer's pages, held until its prefill can no longer write into them."""

    conn: Connection
    fence: Fence
    since: float = field(default_factory=time.monotonic)


@dataclass
class Orphan:
    conn: Connection
    msg: P.ReserveRequest
    arrived: float


class DecodeReceiver(PrefillAcceptor):
    role = "decode"

    def __init__(self, cfg: DisaggConfig, scheduler: SchedulerSide, worker: WorkerSide) -> None:
        super().__init__(cfg, scheduler, worker)
        self.transfers: dict[str, DecodeTransfer] = {}  # by transfer id
        self.orphans: dict[str, Orphan] = {}
        self.refused: dict[
            str, tuple[str, float]
        ] = {}  # transfer id -> (why, when): answers a late prefill
        self.ended: dict[
            str, float
        ] = {}  # transfer id -> when it failed: its late pieces are dropped quietly
        self.fences: dict[str, Fenced] = {}  # transfer id -> pages prefill may still write into
        self.intakes = self.backend.intakes(worker)  # by ChunkHeader.in_place: how pieces came
        self.addr = self.transport.listen(
            self.cfg.transfer_host, self.cfg.transfer_port, self._on_message, self._on_close
        )
        log.info(
            "decode transfer listener addr=%s instance=%s layout=%s",
            self.addr,
            self.instance_id,
            self.layout,
        )

    @property
    def in_flight(self) -> bool:
        return (
            bool(self.transfers or self.orphans or self.refused or self.fences)
            or not self.events.empty()
        )

    def state_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(("reserved", "receiving"), 0)
        for t in self.transfers.values():
            counts[t.sm.state.value] += 1
        counts["orphaned"] = len(self.orphans)  # prefill's reservation came before decode's copy
        counts["fenced"] = len(self.fences)  # failed; pages held until prefill stops writing
        return counts

    # -- engine hooks --------------------------------------------------------------------------------

    def add(self, req, pd: P.PDParams) -> None:
        c = self.cfg
        t = DecodeTransfer(req, pd, P.decode_machine(c.bootstrap_timeout_s, c.transfer_timeout_s))
        if pd.transfer_id in self.transfers:
            self._emit_failure(
                req.rid, pd.transfer_id, P.Cause.IDENTITY, "duplicate transfer id", "new"
            )
            return
        try:  # back-pressure: only what fits next to what admitted requests may still need
            self.sched.reserve(req)
        except OutOfPages as e:
            self._emit_failure(req.rid, pd.transfer_id, P.Cause.NO_KV, str(e), "new")
            self.reject(pd.transfer_id, str(e))
            return
        # Page kinds of the cached prefix are installed already; the state is sent whole.
        t.filled = {
            k.name: 0 if k.unit == SLOT else req.matched_tokens for k in self.kind_by_name.values()
        }
        t.resume_rows = self.sched.caches_prompts
        self.transfers[pd.transfer_id] = t
        orphan = self.orphans.pop(pd.transfer_id, None)
        if orphan is not None:
            self._match(t, orphan.conn, orphan.msg)

    def reject(self, transfer_id: str, reason: str) -> None:
        orphan = self.orphans.pop(transfer_id, None)
        if orphan is not None:
            self._send(orphan.conn, P.ReserveAck(transfer_id, False, reason))
        else:
            self.refused[transfer_id] = (reason, time.monotonic())

    def abort(self, rid: str) -> bool:
        for t in list(self.transfers.values()):
            if t.req.rid == rid:
                sent = self._send(
                    t.conn, P.Failure(t.pd.transfer_id, P.Cause.ABORTED, "aborted on decode")
                )
                self._drop(t, fence=sent)
                self._count_failure(P.Cause.ABORTED)
                log.info(
                    "transfer aborted rid=%s transfer_id=%s state=%s",
                    rid,
                    t.pd.transfer_id,
                    t.sm.state.value,
                )
                return True
        return False

    # -- events --------------------------------------------------------------------------------------

    def _match(self, t: DecodeTransfer, conn: Connection, msg: P.ReserveRequest) -> None:
        req = t.req
        if (
            msg.rid != req.rid
            or msg.num_tokens != len(req.prompt_ids)
            or msg.prompt_hash != P.prompt_hash(req.prompt_ids)
        ):
            why = (
                f"prefill's request (rid {msg.rid}, {msg.num_tokens} tokens, hash {msg.prompt_hash}) does not "
                f"match decode's (rid {req.rid}, {len(req.prompt_ids)} tokens)"
            )
            self._send(conn, P.ReserveAck(t.pd.transfer_id, False, why))
            return self._fail(t, P.Cause.IDENTITY, why, notify=False)
        t.conn = conn
        t.sm.to(TState.RECEIVING)
        ack = P.ReserveAck(
            t.pd.transfer_id, True, pages=list(req.pages), slot=req.state_slot,
            skip_tokens=req.matched_tokens, resume_rows=t.resume_rows,
        )  # fmt: skip
        if not self._send(conn, ack):
            self._fail(
                t,
                P.Cause.PEER_LOST,
                "connection to prefill lost while acknowledging the reservation",
            )

    def _handle(self, ev: Event) -> None:
        msg = ev.msg
        if isinstance(msg, P.Heartbeat):
            return
        tid = getattr(msg, "transfer_id", "")
        t = self.transfers.get(tid)
        if isinstance(msg, P.ReserveRequest):
            if tid in self.refused:
                self._send(ev.conn, P.ReserveAck(tid, False, self.refused.pop(tid)[0]))
            elif tid in self.ended:  # aborted or failed here first: answer now, not at a timeout
                self._send(ev.conn, P.ReserveAck(tid, False, "decode already ended this transfer"))
            elif t is None:
                self.orphans[tid] = Orphan(ev.conn, msg, time.monotonic())
            elif t.sm.state != TState.RESERVED:
                self._send(ev.conn, P.ReserveAck(tid, False, "transfer id already in use"))
            else:
                self._match(t, ev.conn, msg)
            return
        if isinstance(msg, P.Released | P.Failure) and tid in self.fences:
            # prefill stopped writing (a Failure of its own says so too): the pages may go back
            if self.fences[tid].conn is ev.conn:
                self._lift(tid)
            return
        if isinstance(msg, P.Released):
            return  # nothing fenced (never matched, or its connection closed first)
        if t is None:
            if isinstance(msg, P.Failure):
                self.orphans.pop(tid, None)
            elif tid in self.ended:
                log.debug(
                    "late piece of a failed transfer dropped type=%s transfer_id=%s",
                    type(msg).__name__,
                    tid,
                )
            else:
                log.warning(
                    "piece for unknown transfer dropped type=%s transfer_id=%s peer=%s",
                    type(msg).__name__,
                    tid,
                    ev.conn.peer,
                )
                self._send(ev.conn, P.Failure(tid, P.Cause.IDENTITY, "decode has no such transfer"))
            return
        if ev.conn is not t.conn and not isinstance(msg, P.Failure):
            return self._fail(
                t,
                P.Cause.IDENTITY,
                f"piece from {ev.conn.peer}, but the reservation belongs to "
                f"{t.conn.peer if t.conn else 'no peer yet'}",
            )
        if isinstance(msg, P.Failure):
            if ev.conn is t.conn or t.conn is None:
                self._fail(
                    t,
                    msg.cause if msg.cause != P.Cause.ABORTED else P.Cause.PEER_FAILED,
                    f"prefill reported: {msg.message}",
                    notify=False,
                )
        elif isinstance(msg, P.ChunkHeader):
            self._install(t, msg, ev)
        elif isinstance(msg, P.FirstToken):
            self._finish(t, msg)

    def _install(self, t: DecodeTransfer, h: P.ChunkHeader, ev: Event) -> None:
        req, n_tok = t.req, len(t.req.prompt_ids)
        s, e = h.token_start, h.token_end
        if t.sm.state != TState.RECEIVING:
            return self._fail(t, P.Cause.IDENTITY, f"chunk in state {t.sm.state.value}")
        kinds = [self.kind_by_name.get(name) for name in h.kinds]
        problem = None
        if h.rid != req.rid:
            problem = f"chunk names request {h.rid}, the reservation is for {req.rid}"
        elif not h.kinds or None in kinds or len(set(h.kinds)) != len(h.kinds):
            problem = f"cache kinds {h.kinds} are not a set of this decode's kinds"
        elif len({k.unit for k in kinds}) != 1:
            problem = f"cache kinds {h.kinds} mix pages and slots"
        elif kinds[0].unit == SLOT and (s, e) != (0, n_tok):
            problem = (
                f"state after tokens [{s}, {e}); only the whole {n_tok}-token prompt's is sent"
            )
        elif not 0 <= s < e <= n_tok or any(t.filled[name] != s for name in h.kinds):
            problem = (
                f"tokens [{s}, {e}) of {h.kinds} do not continue the {n_tok}-token prompt's "
                f"caches (installed up to {sorted({t.filled[x] for x in h.kinds})})"
            )
        if problem:
            return self._fail(t, P.Cause.IDENTITY, problem)
        page_size = self.worker.page_size
        rows = piece_rows(kinds, req.pages, req.state_slot, page_size, s, e, n_tok, t.resume_rows)
        expected = expected_bytes(kinds, rows)
        began = time.monotonic()
        intake = self.intakes[h.in_place]  # framed bytes, or rows prefill wrote in place
        bad = intake.problem(h, ev.payload, ev.checksum_ok, kinds, rows, expected)
        if bad:
            return self._fail(t, *bad)
        facts = (kinds, list(req.pages), req.state_slot, s, e, n_tok, t.resume_rows)
        intake.install(*facts, ev.payload)  # framed: through the worker side, on every TP rank
        for name in h.kinds:
            t.filled[name] = e
        t.num_chunks += 1
        t.install_s += time.monotonic() - began
        self._count_bytes(expected, intake.name)

    def _arrived_ok(self, h: P.ChunkHeader, payload: memoryview, conn: Connection) -> bool:
        return self.intakes[h.in_place].arrived_ok(h, payload, conn)

    def _finish(self, t: DecodeTransfer, f: P.FirstToken) -> None:
        req = t.req
        if t.sm.state != TState.RECEIVING or f.rid != req.rid:
            return self._fail(
                t, P.Cause.IDENTITY, f"first token for {f.rid} in state {t.sm.state.value}"
            )
        n_tok = len(req.prompt_ids)
        if any(n != n_tok for n in t.filled.values()) or f.num_chunks != t.num_chunks:
            done = t.filled.values()
            return self._fail(
                t,
                P.Cause.IDENTITY,
                f"first token after {t.num_chunks} of {f.num_chunks} pieces "
                f"(prompt caches per kind: {min(done)}..{max(done)} of {n_tok} tokens)",
            )
        if not 0 <= f.token_id < self.worker.vocab_size:
            return self._fail(
                t, P.Cause.IDENTITY, f"first token {f.token_id} is outside the vocabulary"
            )
        t.sm.to(TState.DONE)
        del self.transfers[t.pd.transfer_id]
        self._send(t.conn, P.TransferDone(t.pd.transfer_id))
        self._observe("transfer", time.monotonic() - t.reserved)  # reserved -> all installed
        self._observe("install", t.install_s)
        req.num_computed = len(req.prompt_ids)
        req.resume_from = self._resume_from(t, len(req.prompt_ids))
        # usage: prompt tokens whose KV was reused, by prefill (not computed) or here (not moved)
        req.num_cached_tokens = max(f.cached_tokens, req.matched_tokens)
        top = None if f.top_logprobs is None else [[TokenLogprob(a, b) for a, b in f.top_logprobs]]
        first = RequestOutput(
            req.rid,
            [f.token_id],
            None if f.logprob is None else [f.logprob],
            top,
            num_prompt_tokens=len(req.prompt_ids),
            num_cached_tokens=req.num_cached_tokens,
        )
        self.sched.admit_transferred(req, first)  # emitted; decoding, or finished by the token

    def _resume_from(self, t: DecodeTransfer, n: int) -> int:
        """The first page boundary where a request could resume from the received pages: every
        kind read back `keep_last` tokens has its rows from there - keep_last on (the prefix
        cache marks the pages ending before it as not resumable, radix.py); 0: all rows came."""
        kinds = [k for k in self.kind_by_name.values() if k.unit == PAGE and k.keep_last]
        firsts = [(k.row_range(0, n, n, t.resume_rows)[0] * k.ratio, k.keep_last) for k in kinds]
        return max((first + back for first, back in firsts if first), default=0)

    def _drop(self, t: DecodeTransfer, fence: bool) -> None:
        """End a transfer here. `fence`: prefill was just told, and may still be writing into the
        pages it was given (RECEIVING): they stay held until it says it stopped."""
        known = t.sm.state == TState.RECEIVING and t.conn is not None  # prefill has the pages
        if not t.sm.final:
            t.sm.to(TState.FAILED)
        tid = t.pd.transfer_id
        self.ended[tid] = time.monotonic()
        self.transfers.pop(tid, None)
        if fence and known:
            self.fences[tid] = Fenced(t.conn, self.sched.finish_fenced(t.req, "error"))
        else:
            self.sched.finish(t.req, "error")

    def _lift(self, tid: str) -> None:
        self.sched.release(self.fences.pop(tid).fence)

    def _fail(self, t: DecodeTransfer, cause: str, message: str, notify: bool = True) -> None:
        state = t.sm.state.value
        sent = notify and self._send(t.conn, P.Failure(t.pd.transfer_id, cause, message))
        self._drop(t, fence=sent)
        self._emit_failure(t.req.rid, t.pd.transfer_id, cause, message, state)

    def _on_conn_lost(self, conn: Connection, reason: str) -> None:
        self._handshakes.pop(conn, None)
        self._lost_peer(conn)
        self.backend.forget(conn)  # what the backend kept of this peer (nixl: its agent's name)
        for tid, f in list(self.fences.items()):
            if f.conn is conn:  # nothing more arrives on it: nothing more is written
                self._lift(tid)
        for tid, o in list(self.orphans.items()):
            if o.conn is conn:
                del self.orphans[tid]
        for t in list(self.transfers.values()):
            if t.conn is conn:
                self._fail(
                    t, P.Cause.PEER_LOST, f"connection to prefill lost: {reason}", notify=False
                )

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for t in list(self.transfers.values()):
            if t.sm.expired(now):
                self._fail(
                    t,
                    P.Cause.TIMEOUT,
                    f"no progress for {t.sm.timeouts_s[t.sm.state]:.0f}s "
                    f"in state {t.sm.state.value}",
                )
        for tid, (_, when) in list(self.refused.items()):
            if now - when > self.cfg.bootstrap_timeout_s:
                del self.refused[tid]
        for tid, when in list(self.ended.items()):
            if now - when > self.cfg.bootstrap_timeout_s:
                del self.ended[tid]
        for tid, f in list(self.fences.items()):
            if now - f.since > self.cfg.bootstrap_timeout_s:
                # A peer that never says it stopped is hung up on; only then do the pages go back.
                log.warning(
                    "prefill never released a failed transfer's pages, closing peer=%s transfer_id=%s",
                    f.conn.peer,
                    tid,
                )
                f.conn.close()
                self._lift(tid)
        for tid, o in list(self.orphans.items()):
            if now - o.arrived > self.cfg.bootstrap_timeout_s:
                del self.orphans[tid]
                self._send(
                    o.conn,
                    P.ReserveAck(tid, False, "decode never received its copy of the request"),
                )
