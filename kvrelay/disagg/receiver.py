"""Decode side: reserve pages, check every piece against the reservation, install it, then decode.

Per request: RESERVED (pages held; waiting for prefill's ReserveRequest) -> RECEIVING (matched;
pieces arriving as prefill computes the prompt chunk by chunk, each checked: transfer id, request
id, connection, cache kind, layer range, token range (continuing where that layer's KV ends),
size, checksum) -> DONE (installed; the request joins the scheduler with
num_computed = prompt length and the first token appended); any state -> FAILED (pages freed,
prefill told, error output). A ReserveRequest that arrives before decode's own copy of the request
waits as an orphan until that copy arrives or its deadline passes.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from kvrelay.cache.page_allocator import pages_for
from kvrelay.disagg import protocol as P
from kvrelay.disagg.agent import Event, TransferAgent, token_slots
from kvrelay.disagg.protocol import TState
from kvrelay.disagg.transport.base import Connection
from kvrelay.engine.messages import RequestOutput, TokenLogprob

log = logging.getLogger("kvrelay.disagg")


@dataclass
class DecodeTransfer:
    req: object
    pd: P.PDParams
    sm: P.TransferStateMachine
    conn: Connection | None = None
    filled: list[int] = field(default_factory=list)  # per layer: prompt tokens installed
    num_chunks: int = 0


@dataclass
class Orphan:
    conn: Connection
    msg: P.ReserveRequest
    arrived: float


class DecodeReceiver(TransferAgent):
    role = "decode"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.transfers: dict[str, DecodeTransfer] = {}  # by transfer id
        self.orphans: dict[str, Orphan] = {}
        self.refused: dict[
            str, tuple[str, float]
        ] = {}  # transfer id -> (why, when): answers a late prefill
        self.ended: dict[
            str, float
        ] = {}  # transfer id -> when it failed: its late pieces are dropped quietly
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
        return bool(self.transfers or self.orphans or self.refused) or not self.events.empty()

    def state_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(("reserved", "receiving"), 0)
        for t in self.transfers.values():
            counts[t.sm.state.value] += 1
        counts["orphaned"] = len(self.orphans)  # prefill's reservation came before decode's copy
        return counts

    def _on_hello(self, conn: Connection, msg: P.Hello) -> None:
        conn.send(P.encode(P.Hello(self.instance_id, self.role, self.layout)))
        if msg.layout != self.layout:
            log.error(
                "prefill peer=%s has cache layout %s, decode has %s: refusing",
                conn.peer,
                msg.layout,
                self.layout,
            )
            conn.close()
        else:
            log.info("prefill connected peer=%s instance=%s", conn.peer, msg.instance_id)

    # -- engine hooks --------------------------------------------------------------------------------

    def add(self, req, pd: P.PDParams) -> None:
        eng, c = self.engine, self.cfg
        sched, alloc = eng.scheduler, eng.runner.allocator
        t = DecodeTransfer(req, pd, P.decode_machine(c.bootstrap_timeout_s, c.transfer_timeout_s))
        t.filled = [0] * eng.src.config.num_layers
        if pd.transfer_id in self.transfers:
            self._emit_failure(
                req.rid, pd.transfer_id, P.Cause.IDENTITY, "duplicate transfer id", "new"
            )
            return
        # Back-pressure: admit only what fits next to what running and reserved requests may still need.
        committed = sum(sched._future_pages(r) for r in sched.running + list(sched.waiting))
        committed += sum(sched._future_pages(x.req) for x in self.transfers.values())
        need_now = pages_for(len(req.prompt_ids), eng.runner.page_size)
        need_all = sched._future_pages(req)
        free = alloc.num_free - committed
        if need_all > free:
            msg = f"decode KV cache full: the request needs {need_all} pages, {max(free, 0)} are uncommitted"
            self._emit_failure(req.rid, pd.transfer_id, P.Cause.NO_KV, msg, "new")
            self.reject(pd.transfer_id, msg)
            return
        req.pages = alloc.alloc(need_now)
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
                self._drop(t)
                self._count_failure(P.Cause.ABORTED)
                self._send(
                    t.conn, P.Failure(t.pd.transfer_id, P.Cause.ABORTED, "aborted on decode")
                )
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
        if not self._send(conn, P.ReserveAck(t.pd.transfer_id, True)):
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
        eng, req = self.engine, t.req
        kv = eng.runner.kv.buffer
        n_tok = len(req.prompt_ids)
        l0, l1, s, e = h.layer_start, h.layer_end, h.token_start, h.token_end
        if t.sm.state != TState.RECEIVING:
            return self._fail(t, P.Cause.IDENTITY, f"chunk in state {t.sm.state.value}")
        problem = None
        if h.rid != req.rid:
            problem = f"chunk names request {h.rid}, the reservation is for {req.rid}"
        elif h.kind != "kv":
            problem = f"unknown cache kind {h.kind!r}"
        elif not 0 <= l0 < l1 <= len(t.filled):
            problem = f"layer range [{l0}, {l1}) is invalid"
        elif not 0 <= s < e <= n_tok or any(f != s for f in t.filled[l0:l1]):
            problem = (
                f"tokens [{s}, {e}) of layers [{l0}, {l1}) do not continue the {n_tok}-token "
                f"prompt's KV (installed up to {t.filled[l0:l1]})"
            )
        if problem:
            return self._fail(t, P.Cause.IDENTITY, problem)
        shape = (2, l1 - l0, e - s, kv.shape[4], kv.shape[5])
        expected = kv.element_size() * math.prod(shape)
        if ev.payload is None or ev.payload.nbytes != expected or h.nbytes != expected:
            got = 0 if ev.payload is None else ev.payload.nbytes
            return self._fail(t, P.Cause.IDENTITY, f"chunk of {got} bytes, expected {expected}")
        if not ev.checksum_ok:
            return self._fail(
                t, P.Cause.CHECKSUM, f"checksum mismatch on layers [{l0}, {l1}) tokens [{s}, {e})"
            )
        src = torch.frombuffer(ev.payload, dtype=torch.uint8).view(kv.dtype).view(shape)
        slots = token_slots(req.pages, s, e, eng.runner.page_size).to(kv.device)
        flat = kv.view(2, kv.shape[1], -1, kv.shape[4], kv.shape[5])  # pages x slots -> slots
        flat[:, l0:l1].index_copy_(2, slots, src.to(kv.device))
        t.filled[l0:l1] = [e] * (l1 - l0)
        t.num_chunks += 1

    def _finish(self, t: DecodeTransfer, f: P.FirstToken) -> None:
        eng, req = self.engine, t.req
        if t.sm.state != TState.RECEIVING or f.rid != req.rid:
            return self._fail(
                t, P.Cause.IDENTITY, f"first token for {f.rid} in state {t.sm.state.value}"
            )
        n_tok = len(req.prompt_ids)
        if any(n != n_tok for n in t.filled) or f.num_chunks != t.num_chunks:
            return self._fail(
                t,
                P.Cause.IDENTITY,
                f"first token after {t.num_chunks} of {f.num_chunks} pieces "
                f"(prompt KV per layer: {min(t.filled)}..{max(t.filled)} of {n_tok} tokens)",
            )
        if not 0 <= f.token_id < eng.src.config.vocab_size:
            return self._fail(
                t, P.Cause.IDENTITY, f"first token {f.token_id} is outside the vocabulary"
            )
        t.sm.to(TState.DONE)
        del self.transfers[t.pd.transfer_id]
        self._send(t.conn, P.TransferDone(t.pd.transfer_id))
        req.num_computed = len(req.prompt_ids)
        req.output_ids.append(f.token_id)
        if req.params.temperature > 0 and req.generator is not None:
            # Prefill drew the first token from this seed: make the same one draw (one exponential per
            # vocabulary entry, as the sampler does) so seeded sampling continues exactly as in one server.
            torch.empty(
                eng.src.config.vocab_size, dtype=torch.float32, device=eng.runner.device
            ).exponential_(generator=req.generator)
        reason = eng._stop_reason(req, f.token_id)
        top = None if f.top_logprobs is None else [[TokenLogprob(a, b) for a, b in f.top_logprobs]]
        eng.emit(
            RequestOutput(
                req.rid,
                [f.token_id],
                None if f.logprob is None else [f.logprob],
                top,
                finish_reason=reason,
                num_prompt_tokens=len(req.prompt_ids),
            )
        )
        if reason is None:
            eng.scheduler.add(req)
        else:
            eng.runner.allocator.free(req.pages)
            req.pages = []

    def _drop(self, t: DecodeTransfer) -> None:
        if not t.sm.final:
            t.sm.to(TState.FAILED)
        self.ended[t.pd.transfer_id] = time.monotonic()
        self.transfers.pop(t.pd.transfer_id, None)
        self.engine.runner.allocator.free(t.req.pages)
        t.req.pages = []

    def _fail(self, t: DecodeTransfer, cause: str, message: str, notify: bool = True) -> None:
        state = t.sm.state.value
        self._drop(t)
        if notify:
            self._send(t.conn, P.Failure(t.pd.transfer_id, cause, message))
        self._emit_failure(t.req.rid, t.pd.transfer_id, cause, message, state)

    def _on_conn_lost(self, conn: Connection, reason: str) -> None:
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
        for tid, o in list(self.orphans.items()):
            if now - o.arrived > self.cfg.bootstrap_timeout_s:
                del self.orphans[tid]
                self._send(
                    o.conn,
                    P.ReserveAck(tid, False, "decode never received its copy of the request"),
                )
