"""The tcp backend's pieces: prefill gathers a piece's rows to host bytes that travel as its
frame's payload; decode checks their size and checksum as the frame arrives and installs them
through the engine's worker side (with tensor parallel: on every rank). Every backend can fall
back to this way (a cuda_ipc side paired with a tcp one)."""

from __future__ import annotations

from kvrelay.cache.spec import CacheKind
from kvrelay.disagg import protocol as P
from kvrelay.disagg.transport.base import (
    Backend,
    Moved,
    Piece,
    PieceFault,
    PieceIntake,
    PieceLink,
    checksum_mismatch,
)
from kvrelay.disagg.transport.tcp import TcpTransport
from kvrelay.engine.pd_connector import WorkerSide


class FramedLink(PieceLink):
    name = "tcp"
    in_place = False

    def __init__(self, worker: WorkerSide, checksum: bool) -> None:
        self.worker, self.checksum = worker, checksum

    def move(self, piece: Piece, fault: PieceFault | None) -> Moved:
        p = piece
        args = (p.kinds, p.pages, p.slot, p.start, p.end, p.prompt_len, p.resume_rows)
        buf = self.worker.gather_rows(*args)
        crc = P.checksum([buf]) if self.checksum else None
        if fault is not None and fault.fires(buf.nbytes):  # TEST ONLY, after the checksum
            buf = fault.damaged(buf)
        return Moved(buf.nbytes, crc, [buf])


class FramedIntake(PieceIntake):
    name = "tcp"

    def __init__(self, worker: WorkerSide, checksum: bool) -> None:
        self.worker, self.checksum = worker, checksum

    def arrived_ok(self, h: P.ChunkHeader, payload: memoryview, conn=None) -> bool:
        if payload.nbytes != h.nbytes:
            return False
        if h.checksum is not None and self.checksum:
            return P.checksum([payload]) == h.checksum
        return True

    def problem(self, h, payload, arrived_ok, kinds, rows, expected):
        got = 0 if payload is None else payload.nbytes
        if got != expected or h.nbytes != expected:
            return P.Cause.IDENTITY, f"chunk of {got} bytes, expected {expected}"
        if not arrived_ok:
            return P.Cause.CHECKSUM, checksum_mismatch(h)
        return None

    def install(
        self, kinds: list[CacheKind], pages: list[int], slot: int, start: int, end: int,
        prompt_len: int, resume_rows: bool, payload: memoryview | None,
    ) -> None:  # fmt: skip
        self.worker.install_rows(kinds, pages, slot, start, end, prompt_len, resume_rows, payload)


class NotShared(PieceIntake):
    """An in-place piece to a decode that shares no memory with its prefill."""

    name = "cuda_ipc"

    def problem(self, h, payload, arrived_ok, kinds, rows, expected):
        return P.Cause.IDENTITY, "an in-place piece, but decode shares no memory"

    def install(self, *facts) -> None:
        raise AssertionError("an in-place piece to a decode that shares no memory is refused")


class TcpBackend(Backend):
    """Headers and bytes in frames over TCP: works everywhere (the CPU tests use it)."""

    name = "tcp"

    def __init__(self, checksum: bool) -> None:
        self.checksum = checksum
        self.transport = TcpTransport()

    def link(self, offer, worker: WorkerSide) -> PieceLink:
        return FramedLink(worker, self.checksum)  # decode's offer (if any) is of no use here

    def intakes(self, worker: WorkerSide) -> dict[bool, PieceIntake]:
        return {False: FramedIntake(worker, self.checksum), True: NotShared()}
