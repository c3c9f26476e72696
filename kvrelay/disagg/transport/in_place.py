"""The cuda_ipc backend's pieces: decode offers its cache tensors at the handshake (CUDA IPC
handles, cuda_ipc.py), prefill copies a piece's rows straight into decode's pages and sends only
the header once the copy is done; decode checks the rows where they landed (device_checksum) and
installs nothing. A peer that shares no memory gets its pieces framed (framed.py)."""

from __future__ import annotations

import torch

from kvrelay.cache.spec import SLOT, CacheKind
from kvrelay.disagg import protocol as P
from kvrelay.disagg.transport.base import (
    LinkError,
    Moved,
    Piece,
    PieceFault,
    PieceIntake,
    PieceLink,
    checksum_mismatch,
)
from kvrelay.disagg.transport.cuda_ipc import device_checksum, export_tensors, open_tensors
from kvrelay.disagg.transport.framed import FramedIntake, FramedLink, TcpBackend
from kvrelay.engine.kv_pieces import gather_rows, piece_rows
from kvrelay.engine.pd_connector import WorkerSide


def check_remote(remote: dict[str, torch.Tensor], kinds: list[CacheKind]) -> tuple[int, int]:
    """Decode's shared tensors are the byte rows of exactly our cache kinds; returns how many
    pages and state slots they hold (what decode's reservations may name)."""
    by_name = {k.name: k for k in kinds}
    if set(remote) != set(by_name):
        raise ValueError(f"decode shares {sorted(remote)[:4]}.., not this layout's kinds")
    pages = slots = 1 << 62
    for name, t in remote.items():
        k = by_name[name]
        mine = k.byte_rows
        if t.dtype != mine.dtype or t.dim() != 2 or t.shape[1] != mine.shape[1]:
            raise ValueError(
                f"{name}: decode shares {t.dtype} {tuple(t.shape)}, "
                f"rows here are {mine.dtype} [*, {mine.shape[1]}]"
            )
        if k.unit == SLOT:
            slots = min(slots, t.shape[0])
        else:
            pages = min(pages, t.shape[0] // k.tensor.shape[1])
    return pages, slots


def reservation_problem(limits: tuple[int, int], pages: list[int], slot: int, need: int) -> str:
    """Writes land where decode's ack says: every page and the slot must exist among decode's
    `limits` (its page and slot counts), and the pages must hold a `need`-page prompt."""
    n_pages, slots = limits
    if len(pages) < need or any(p >= n_pages for p in pages) or slot >= slots:
        return (
            f"decode's reservation ({len(pages)} pages, slot {slot}) does not fit "
            f"a {need}-page prompt in its {n_pages} pages and {slots} slots"
        )
    return ""


class InPlaceLink(PieceLink):
    """Writes pieces into a decode peer's shared tensors (its kinds' byte rows, by name)."""

    name = "cuda_ipc"
    in_place = True

    def __init__(
        self, remote: dict[str, torch.Tensor], kinds: list[CacheKind], page_size: int,
        checksum: bool,
    ) -> None:  # fmt: skip
        self.limits = check_remote(remote, kinds)  # decode's page and slot counts
        self.remote, self.page_size, self.checksum = remote, page_size, checksum

    def destination_problem(self, pages: list[int], slot: int, need_pages: int) -> str:
        return reservation_problem(self.limits, pages, slot, need_pages)

    def move(self, piece: Piece, fault: PieceFault | None) -> Moved:
        p, ps = piece, self.page_size
        facts = (p.start, p.end, p.prompt_len, p.resume_rows)
        src = piece_rows(p.kinds, p.pages, p.slot, ps, *facts)
        dst = piece_rows(p.kinds, p.dst_pages, p.dst_slot, ps, *facts)
        parts = []
        for k, src_r, dst_r in zip(p.kinds, src, dst, strict=True):
            rows, peer_rows = k.byte_rows.index_select(0, src_r), self.remote[k.name]
            peer_rows.index_copy_(0, dst_r.to(peer_rows.device), rows.to(peer_rows.device))
            parts.append(rows.reshape(-1))
        data = torch.cat(parts)
        if fault is not None and fault.fires(data.numel()):  # TEST ONLY: what decode will read
            k, r = next((k, r) for k, r in zip(p.kinds, dst, strict=True) if len(r))
            fault.damage(self.remote[k.name][r[0]])
        if data.device.type == "cuda":
            torch.cuda.synchronize(data.device)  # decode reads the rows once the header arrives
        return Moved(data.numel(), device_checksum(data) if self.checksum else None)


class InPlaceIntake(PieceIntake):
    """Checks the rows prefill wrote into this decode's pages; they are installed already."""

    name = "cuda_ipc"

    def __init__(self, checksum: bool) -> None:
        self.checksum = checksum

    def problem(self, h, payload, arrived_ok, kinds, rows, expected):
        if h.nbytes != expected:
            return P.Cause.IDENTITY, f"piece of {h.nbytes} bytes, expected {expected}"
        if h.checksum is not None and self.checksum:
            if device_checksum(gather_rows(kinds, rows)) != h.checksum:
                return P.Cause.CHECKSUM, checksum_mismatch(h)
        return None

    def install(self, *facts) -> None:
        pass  # prefill wrote the rows into this decode's pages


class CudaIpcBackend(TcpBackend):
    """Headers as frames over TCP; pieces written through CUDA IPC into a peer that offers its
    tensors (same host), framed to one that does not."""

    name = "cuda_ipc"

    def __init__(self, checksum: bool, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError("the cuda_ipc transfer backend needs the engine on a CUDA device")
        super().__init__(checksum)

    def offer(self, kinds: list[CacheKind], conn, peer: P.Auth) -> dict:
        # prefill writes into these rows, and may now know where they are
        return {"ipc": export_tensors({k.name: k.byte_rows for k in kinds})}

    def link(self, offer: P.Auth, worker: WorkerSide) -> PieceLink:
        if not offer.ipc:  # decode shares nothing (a tcp or nixl decode): the bytes go in frames
            return FramedLink(worker, self.checksum)
        try:
            remote = open_tensors(offer.ipc)
            return InPlaceLink(remote, worker.kinds, worker.page_size, self.checksum)
        except Exception as e:  # a bad description, another host, no peer access: say so
            raise LinkError(
                f"cannot open decode's CUDA IPC handles: {type(e).__name__}: {e}"
            ) from e

    def intakes(self, worker: WorkerSide) -> dict[bool, PieceIntake]:
        return {False: FramedIntake(worker, self.checksum), True: InPlaceIntake(self.checksum)}
