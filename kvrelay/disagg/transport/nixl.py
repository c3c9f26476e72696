"""The nixl backend: KV pieces move with NIXL (NVIDIA's transfer library, UCX underneath) as
one-sided writes from prefill's pages straight into decode's; headers keep travelling as frames
over the authenticated TCP connection (framed.py's transport).

- Decode registers its cache tensors with its NIXL agent once, at start (`intakes`). To a prefill
  that proved it holds the PD secret and named its own agent, decode's Auth answers with its
  agent's metadata and where each cache kind's rows lie (protocol.NixlAgent, covered by decode's
  proof): nothing of it ever goes through a NIXL listener or metadata server (the agents run
  with none), and decode loads no peer's metadata at all (a write needs only the writer to know
  the target).
- Prefill loads decode's metadata (`link`), writes each piece's rows into the pages decode's
  ack names (run-merged descriptors; NIXL refuses any address outside what decode registered),
  with a notification that names the piece (transfer id, first kind, token range); once the
  write completed it sends the piece's header.
- Decode takes a piece when its header arrives on the connection and that connection's agent's
  notification for it came (`arrived_ok`, bounded wait), then checks the rows where they landed
  (in_place.InPlaceIntake: size and device_checksum), as for cuda_ipc. A write that cannot
  complete within WRITE_DEADLINE_S (decode gone) raises ConnectionError: the sender fails the
  transfer as peer_connection_lost.
- A peer of another backend gets its pieces framed (a tcp or cuda_ipc side).

`nixl` is optional (`pip install 'kvrelay[nixl]'`): without the package this backend refuses to
start with that sentence (config.DisaggConfig.backend_problem).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict

import numpy as np
import torch

from kvrelay.cache.spec import SLOT, CacheKind
from kvrelay.config import DisaggConfig
from kvrelay.disagg import protocol as P
from kvrelay.disagg.transport.base import (
    Connection,
    LinkError,
    Moved,
    Piece,
    PieceFault,
    PieceIntake,
    PieceLink,
)
from kvrelay.disagg.transport.cuda_ipc import device_checksum
from kvrelay.disagg.transport.framed import FramedIntake, FramedLink, TcpBackend
from kvrelay.disagg.transport.in_place import InPlaceIntake, reservation_problem
from kvrelay.engine.kv_pieces import gather_rows, piece_rows
from kvrelay.engine.pd_connector import WorkerSide

log = logging.getLogger("kvrelay.disagg.nixl")

WRITE_DEADLINE_S = 10.0  # one piece's write, posted to done; past it the peer counts as gone
NOTIF_WAIT_S = 2.0  # after a piece's header: how long its notification may still take
POLL_S = 0.002  # decode: how often its agent is progressed and its notifications collected
MAX_NOTIFS = 1 << 16  # notifications kept for headers still to come (the oldest go first)


def load_nixl():
    problem = DisaggConfig.backend_problem("nixl")
    if problem:
        raise ValueError(problem)
    from nixl_cu13 import _api

    return _api


def piece_tag(transfer_id: str, kind: str, start: int, end: int) -> bytes:
    """A piece's notification: the transfer, its first cache kind and its token range."""
    return f"{transfer_id}|{kind}|{start}|{end}".encode()


def _mem(device: torch.device) -> tuple[str, int]:
    """NIXL's memory type and device id of tensors on `device`."""
    return ("DRAM", 0) if device.type == "cpu" else ("VRAM", device.index or 0)


class Agent:
    """This process's NIXL agent: UCX, no listener thread, no metadata server, no progress
    thread of NIXL's own (it spins a core); decode progresses it from a light thread of ours
    that collects notifications (`watch`), prefill while it waits for its writes."""

    def __init__(self) -> None:
        api = load_nixl()
        self.name = f"kvrelay-{uuid.uuid4().hex[:16]}"
        conf = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # several threads call it
        )
        self.nx = api.nixl_agent(self.name, conf)
        self.lock = threading.Lock()  # what follows
        self.remote: dict[str, int] = {}  # remote agents loaded -> links using each
        self.senders: dict[str, int] = {}  # agents whose notifications we take -> connections
        self.notifs: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self.arrived = threading.Condition(self.lock)
        self.dropped = 0  # notifications from agents not bound to a connection
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- memory --------------------------------------------------------------------------------

    def register(self, tensors: list[torch.Tensor]) -> None:
        """Register the storages of `tensors` (each once) for every transfer to come."""
        spans: dict[int, tuple[int, int, int, str]] = {}
        mem = _mem(tensors[0].device)
        for t in tensors:
            if _mem(t.device) != mem:
                raise ValueError(f"cache tensors on {tensors[0].device} and {t.device}")
            st = t.untyped_storage()
            spans[st.data_ptr()] = (st.data_ptr(), st.nbytes(), mem[1], "")
        self.nx.register_memory(list(spans.values()), mem[0])

    # -- prefill: writes -----------------------------------------------------------------------

    def load(self, metadata: bytes) -> str:
        with self.lock:
            name = self.nx.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self.remote[name] = self.remote.get(name, 0) + 1
            return name

    def unload(self, name: str) -> None:
        with self.lock:
            n = self.remote.get(name, 0) - 1
            if n > 0:
                self.remote[name] = n
                return
            self.remote.pop(name, None)
        try:
            self.nx.remove_remote_agent(name)
        except Exception as e:  # gone already: nothing to let go of
            log.debug("nixl remove_remote_agent agent=%s error=%s", name, e)

    def write(self, peer: str, local: np.ndarray, remote: np.ndarray, mems, tag: bytes) -> None:
        """One WRITE of `local` descriptors (rows: addr, len, device) into `remote` ones of
        agent `peer`, with notification `tag` (b"": none), waited for; ConnectionError when it
        fails or does not complete within WRITE_DEADLINE_S."""
        handle = None
        try:
            lo = self.nx.get_xfer_descs(local, mems[0])
            ro = self.nx.get_xfer_descs(remote, mems[1])
            handle = self.nx.initialize_xfer("WRITE", lo, ro, peer, tag)
            state = self.nx.transfer(handle)
            deadline = time.monotonic() + WRITE_DEADLINE_S
            polls = 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"a NIXL write to decode's agent did not complete in {WRITE_DEADLINE_S:g}s"
                    )
                polls += 1
                if polls > 200:
                    time.sleep(0.0002)
                state = self.nx.check_xfer_state(handle)
            if state != "DONE":
                raise ConnectionError(f"a NIXL write to decode's agent failed (state {state})")
        except ConnectionError:
            raise
        except Exception as e:  # NIXL's errors: the remote agent disconnected, a bad descriptor
            raise ConnectionError(f"NIXL write to decode failed: {type(e).__name__}: {e}") from e
        finally:
            if handle is not None:
                try:
                    self.nx.release_xfer_handle(handle)
                except Exception as e:  # still posted (a timed-out write): NIXL keeps it
                    log.warning("nixl transfer handle not released error=%s", e)

    # -- decode: notifications -----------------------------------------------------------------

    def watch(self) -> None:
        """Start collecting notifications (decode), which also progresses the agent."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, daemon=True, name="kvrelay-nixl")
            self._watcher.start()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                new = self.nx.get_new_notifs()
            except Exception:  # a bug or a dying agent must not end the watch silently
                log.exception("nixl notifications failed")
                continue
            if not new:
                continue
            with self.lock:
                for sender, msgs in new.items():
                    if sender not in self.senders:
                        self.dropped += len(msgs)  # no authenticated connection names it
                        continue
                    for m in msgs:
                        self.notifs[(sender, bytes(m))] = None
                while len(self.notifs) > MAX_NOTIFS:
                    self.notifs.popitem(last=False)
                self.arrived.notify_all()

    def expect(self, sender: str) -> None:
        with self.lock:
            self.senders[sender] = self.senders.get(sender, 0) + 1

    def forget(self, sender: str) -> None:
        with self.lock:
            n = self.senders.get(sender, 0) - 1
            if n > 0:
                self.senders[sender] = n
                return
            self.senders.pop(sender, None)
            for key in [k for k in self.notifs if k[0] == sender]:
                del self.notifs[key]

    def take(self, sender: str, tag: bytes, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for `sender`'s notification `tag`, and consume it."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while (sender, tag) not in self.notifs:
                left = deadline - time.monotonic()
                if left <= 0 or sender not in self.senders:
                    return False
                self.arrived.wait(left)
            del self.notifs[(sender, tag)]
            return True

    def close(self) -> None:
        self._stop.set()


def regions(kinds: list[CacheKind]) -> list[P.NixlRegion]:
    """Where each kind's byte rows lie (decode's offer)."""
    out = []
    for k in kinds:
        rows = k.byte_rows
        if rows.stride(1) != 1:
            raise ValueError(f"{k.name}: its rows are not contiguous bytes")
        if rows.shape[1] != k.row_bytes:
            raise ValueError("the nixl transfer backend does not run with tensor parallel yet")
        dev = -1 if rows.device.type == "cpu" else rows.device.index or 0
        out.append(
            P.NixlRegion(k.name, rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), dev)
        )
    return out


def check_regions(
    offered: list[P.NixlRegion], kinds: list[CacheKind]
) -> tuple[dict[str, P.NixlRegion], tuple[int, int]]:
    """Decode's regions are the rows of exactly our cache kinds, as wide as ours; returns them
    by name and how many pages and state slots they hold (what its reservations may name)."""
    by_name = {k.name: k for k in kinds}
    remote = {r.name: r for r in offered}
    if set(remote) != set(by_name) or len(remote) != len(offered):
        raise LinkError(f"decode offers {sorted(remote)[:4]}.., not this layout's kinds")
    pages = slots = 1 << 62
    for name, r in remote.items():
        k = by_name[name]
        if r.row_bytes != k.row_bytes or r.row_stride < r.row_bytes:
            raise LinkError(
                f"{name}: decode's rows are {r.row_bytes} bytes (stride {r.row_stride}), "
                f"here {k.row_bytes}"
            )
        if k.unit == SLOT:
            slots = min(slots, r.rows)
        else:
            pages = min(pages, r.rows // k.tensor.shape[1])
    return remote, (pages, slots)


def _runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of rows consecutive on both sides: (first source row, first destination row,
    length) of each."""
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((starts, [len(src)])))
    return src[starts], dst[starts], lens


class NixlLink(PieceLink):
    """Prefill: writes pieces into one decode's registered pages through NIXL."""

    name = "nixl"
    in_place = True

    def __init__(
        self, agent: Agent, peer: str, remote: dict[str, P.NixlRegion], limits: tuple[int, int],
        scratch: torch.Tensor, page_size: int, checksum: bool,
    ) -> None:  # fmt: skip
        self.agent, self.peer, self.remote, self.limits = agent, peer, remote, limits
        self.scratch, self.page_size, self.checksum = scratch, page_size, checksum
        self.closed = False

    def destination_problem(self, pages: list[int], slot: int, need_pages: int) -> str:
        return reservation_problem(self.limits, pages, slot, need_pages)

    def _descs(self, piece: Piece, src, dst) -> tuple[np.ndarray, np.ndarray, int]:
        local, remote, nbytes = [], [], 0
        for k, s, d in zip(piece.kinds, src, dst, strict=True):
            if not len(s):
                continue
            rows, reg = k.byte_rows, self.remote[k.name]
            s_np, d_np = s.cpu().numpy().astype(np.int64), d.cpu().numpy().astype(np.int64)
            width, stride = k.row_bytes, rows.stride(0)
            if stride == width and reg.row_stride == width:  # whole runs of rows at once
                s0, d0, n = _runs(s_np, d_np)
            else:
                s0, d0, n = s_np, d_np, np.ones_like(s_np)
            local.append(np.stack([rows.data_ptr() + s0 * stride, n * width, 0 * n], 1))
            remote.append(np.stack([reg.addr + d0 * reg.row_stride, n * width, 0 * n], 1))
            nbytes += width * len(s_np)
        if not local:
            return np.zeros((0, 3), np.uint64), np.zeros((0, 3), np.uint64), 0
        lo, ro = np.concatenate(local), np.concatenate(remote)
        lo[:, 2] = _mem(self.scratch.device)[1]
        dev = next(iter(self.remote.values())).device
        ro[:, 2] = max(dev, 0)
        return lo.astype(np.uint64), ro.astype(np.uint64), nbytes

    def move(self, piece: Piece, fault: PieceFault | None) -> Moved:
        if self.closed:
            raise ConnectionError("decode's NIXL agent was let go (its connection closed)")
        p, ps = piece, self.page_size
        facts = (p.start, p.end, p.prompt_len, p.resume_rows)
        src = piece_rows(p.kinds, p.pages, p.slot, ps, *facts)
        dst = piece_rows(p.kinds, p.dst_pages, p.dst_slot, ps, *facts)
        local, remote, nbytes = self._descs(p, src, dst)
        crc = device_checksum(gather_rows(p.kinds, src)) if self.checksum else None
        if not nbytes:
            return Moved(0, crc)  # nothing to write, nothing to wait for (decode knows: 0 bytes)
        if self.scratch.device.type == "cuda":
            torch.cuda.synchronize(self.scratch.device)  # the rows are computed before they go
        dev = next(iter(self.remote.values())).device
        mems = (_mem(self.scratch.device)[0], "DRAM" if dev < 0 else "VRAM")
        tag = piece_tag(p.transfer_id, p.kinds[0].name, p.start, p.end)
        damaged = fault is not None and fault.fires(nbytes)  # TEST ONLY: what decode will read
        self.agent.write(self.peer, local, remote, mems, b"" if damaged else tag)
        if damaged:  # the first row again, damaged, from the registered scratch row
            k, r = next((k, r) for k, r in zip(p.kinds, src, strict=True) if len(r))
            row = self.scratch[: k.row_bytes]
            row.copy_(k.byte_rows[r[0]])
            fault.damage(row)
            one = local[:1].copy()
            one[0, 0], one[0, 1] = row.data_ptr(), k.row_bytes
            first = remote[:1].copy()
            first[0, 1] = k.row_bytes
            self.agent.write(self.peer, one, first, mems, tag)
        return Moved(nbytes, crc)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.agent.unload(self.peer)


class NixlIntake(InPlaceIntake):
    """Decode: a piece is taken once its header came on the connection and that connection's
    agent's notification for it too; then its rows are checked where they landed."""

    name = "nixl"

    def __init__(self, backend: NixlBackend, checksum: bool) -> None:
        super().__init__(checksum)
        self.backend = backend

    def arrived_ok(self, h: P.ChunkHeader, payload: memoryview, conn: Connection) -> bool:
        sender = self.backend.peers.get(conn)
        if sender is None:  # this prefill never named a NIXL agent
            return False
        if h.nbytes == 0 or not h.kinds:
            return True  # nothing was written (problem() checks that nothing was to be)
        tag = piece_tag(h.transfer_id, h.kinds[0], h.token_start, h.token_end)
        return self.backend.agent.take(sender, tag, NOTIF_WAIT_S)

    def problem(self, h, payload, arrived_ok, kinds, rows, expected):
        if h.nbytes != expected:
            return P.Cause.IDENTITY, f"piece of {h.nbytes} bytes, expected {expected}"
        if not arrived_ok:
            why = (
                f"no NIXL notification for {h.kinds[0]}.. tokens [{h.token_start}, "
                f"{h.token_end}) within {NOTIF_WAIT_S:g}s of its header"
            )
            return P.Cause.TIMEOUT, why
        return super().problem(h, payload, arrived_ok, kinds, rows, expected)


class NixlBackend(TcpBackend):
    """Headers as frames over TCP; pieces written through NIXL into a peer that offers its
    agent, framed to one that does not."""

    name = "nixl"

    def __init__(self, checksum: bool, device: torch.device) -> None:
        self.agent = Agent()  # raises, naming the package, when NIXL is not installed
        super().__init__(checksum)
        self.device = device
        self.peers: dict[Connection, str] = {}  # decode: prefill connection -> its agent's name
        self._offer: P.NixlAgent | None = None  # decode: its agent, once registered
        self._scratch: torch.Tensor | None = None  # prefill: once its pages are registered
        self._lock = threading.Lock()

    def introduce(self) -> P.NixlAgent:
        return P.NixlAgent(self.agent.name)

    # -- decode ----------------------------------------------------------------------------------

    def intakes(self, worker: WorkerSide) -> dict[bool, PieceIntake]:
        kinds = worker.kinds
        self.agent.register([k.tensor for k in kinds])  # once: the page pools live as long
        self._offer = P.NixlAgent(
            self.agent.name, self.agent.nx.get_agent_metadata(), regions(kinds)
        )
        self.agent.watch()
        return {False: FramedIntake(worker, self.checksum), True: NixlIntake(self, self.checksum)}

    def offer(self, kinds: list[CacheKind], conn: Connection, peer: P.Auth) -> dict:
        if peer.nixl is None or self._offer is None:  # a tcp or cuda_ipc prefill: it frames
            return {}
        self.peers[conn] = peer.nixl.name
        self.agent.expect(peer.nixl.name)
        return {"nixl": self._offer}

    def forget(self, conn: Connection) -> None:
        name = self.peers.pop(conn, None)
        if name is not None:
            self.agent.forget(name)

    # -- prefill ---------------------------------------------------------------------------------

    def link(self, offer: P.Auth, worker: WorkerSide) -> PieceLink:
        if offer.nixl is None or not offer.nixl.metadata:  # a tcp or cuda_ipc decode
            return FramedLink(worker, self.checksum)
        remote, limits = check_regions(offer.nixl.regions, worker.kinds)
        if any(k.byte_rows.shape[1] != k.row_bytes for k in worker.kinds):
            raise LinkError("the nixl transfer backend does not run with tensor parallel yet")
        with self._lock:
            if self._scratch is None:  # our pages once, and a row to damage for fault tests
                kinds = worker.kinds
                width = max(k.row_bytes for k in kinds)
                scratch = torch.zeros(width, dtype=torch.uint8, device=kinds[0].tensor.device)
                self.agent.register([*(k.tensor for k in kinds), scratch])
                self._scratch = scratch
        try:
            name = self.agent.load(offer.nixl.metadata)
        except Exception as e:  # metadata NIXL cannot read, or an agent it cannot reach
            raise LinkError(f"cannot load decode's NIXL agent: {type(e).__name__}: {e}") from e
        if name != offer.nixl.name:
            self.agent.unload(name)
            raise LinkError(
                f"decode's NIXL metadata is agent {name!r}, it said {offer.nixl.name!r}"
            )
        return NixlLink(
            self.agent, name, remote, limits, self._scratch, worker.page_size, self.checksum
        )

    def close(self) -> None:
        self.agent.close()
