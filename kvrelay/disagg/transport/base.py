"""The transfer-backend interface, in two layers.

Frames (`Transport`, `Connection`): messages (header bytes + payload buffers) between peers. The
protocol layer above never sees sockets and this layer never sees tensors: a header is opaque
bytes, a payload is a sequence of bytes-like buffers.

Pieces (`Backend`, `PieceLink`, `PieceIntake`): how one KV piece's bytes get from prefill's pools
into decode's. Prefill's `PieceLink` (one per decode peer, chosen at the handshake) moves them:
tcp gathers them to host bytes that travel as the frame's payload, cuda_ipc writes them straight
into decode's pages. Decode's `PieceIntake` (one per way a piece can come: ChunkHeader.in_place)
checks them and installs them: tcp through the engine's worker side, cuda_ipc verifies the rows
prefill wrote. The sender and receiver state machines only ever call these; the nixl backend
(nixl.py) is one more `Backend`: registered memory, one-sided writes and notifications, headers
still as frames.

What the two sides tell each other of their backend travels in the handshake's Auth messages:
prefill's `introduce()` goes in its Auth, decode's `offer()` (made only once prefill's proof is
checked) in its answer, and prefill's `link()` reads that answer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kvrelay.cache.spec import CacheKind
    from kvrelay.disagg.protocol import Auth, ChunkHeader, NixlAgent
    from kvrelay.engine.pd_connector import WorkerSide

Buffer = bytes | bytearray | memoryview


class Connection(ABC):
    peer: str  # "host:port" of the other side
    # The largest payload a received frame may announce; a larger one closes the connection
    # before a byte of it is read (or allocated). 0 until the peer is authenticated.
    max_payload: int = 0

    @abstractmethod
    def send(self, header: bytes, buffers: Sequence[Buffer] = ()) -> None:
        """Send one frame; thread-safe; raises ConnectionError when the peer is gone."""

    @abstractmethod
    def close(self) -> None: ...

    # Set once the agent's handshake proved the peer holds the PD secret: a backend may give the
    # connection more (a reader thread, larger frames) only from then on.
    is_authenticated: bool = False

    def authenticated(self) -> None:
        self.is_authenticated = True

    @property
    @abstractmethod
    def closed(self) -> bool: ...


# on_message(conn, header, payload) and on_close(conn, reason) run on the backend's threads.
OnMessage = Callable[[Connection, bytes, memoryview], None]
OnClose = Callable[[Connection, str], None]


class Transport(ABC):
    @abstractmethod
    def listen(self, host: str, port: int, on_message: OnMessage, on_close: OnClose) -> str:
        """Accept peers; returns the address ("host:port") peers connect to."""

    @abstractmethod
    def connect(
        self, addr: str, on_message: OnMessage, on_close: OnClose, timeout_s: float
    ) -> Connection: ...

    @abstractmethod
    def close(self) -> None: ...


# -- pieces ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """A piece prefill moves: the rows of `kinds` that prompt tokens [start, end) filled (a slot
    kind: its state after the whole prompt), read from `pages`/`slot` (prefill's) and landing in
    `dst_pages`/`dst_slot` (decode's, from its reservation ack)."""

    kinds: list[CacheKind]
    start: int
    end: int
    prompt_len: int
    resume_rows: bool  # also the window rows a later hit on decode's cached pages reads
    pages: list[int]
    slot: int
    dst_pages: list[int]
    dst_slot: int
    transfer_id: str = ""  # the transfer it belongs to (a backend's notification names it)


@dataclass
class Moved:
    """What a link did with a piece: its size and checksum (for the header), and the frame's
    payload (empty when the bytes went another way)."""

    nbytes: int
    checksum: int | None
    buffers: list[Buffer] = field(default_factory=list)


class PieceFault(Protocol):
    """TEST ONLY (disagg/faults.py): damage to one piece's bytes after their checksum was taken,
    where decode will read them; a link calls it only when the transfer was given one."""

    def fires(self, nbytes: int) -> bool:
        """Damage this piece (of `nbytes` bytes)?"""
        ...

    def damaged(self, buf: memoryview) -> memoryview:
        """A damaged copy of a payload."""
        ...

    def damage(self, row: torch.Tensor) -> None:
        """Damage one row (uint8) in place."""
        ...


class LinkError(Exception):
    """A decode peer's offer (its Auth's ipc or nixl) cannot be used: the handshake fails with
    cause ipc."""


class PieceLink(ABC):
    """Prefill: how pieces' bytes reach one decode peer."""

    name: str  # the backend the bytes count under (pd_bytes metrics)
    in_place: bool  # ChunkHeader.in_place: the rows are in decode's pages when the header arrives

    def destination_problem(self, pages: list[int], slot: int, need_pages: int) -> str:
        """Why decode's reservation (pages, slot) cannot take a `need_pages`-page prompt's
        writes ("" when it can)."""
        return ""

    @abstractmethod
    def move(self, piece: Piece, fault: PieceFault | None) -> Moved:
        """Move the piece's bytes (its header, built from the result, goes next; a write into
        decode's memory must be complete before). Engine thread. Raises ConnectionError when
        the bytes cannot reach decode (the transfer fails as peer_connection_lost)."""

    def close(self) -> None:
        """The peer's connection is gone: let go of what the link holds of it."""
        return


class PieceIntake(ABC):
    """Decode: how pieces that came one way are checked and installed."""

    name: str  # the backend the bytes count under (pd_bytes metrics)

    def arrived_ok(self, h: ChunkHeader, payload: memoryview, conn: Connection) -> bool:
        """On the transport thread of `conn`, as the frame arrives: its payload's size and
        checksum (nixl: whether the piece's notification came)."""
        return True

    @abstractmethod
    def problem(
        self, h: ChunkHeader, payload: memoryview | None, arrived_ok: bool,
        kinds: list[CacheKind], rows: list[torch.Tensor], expected: int,
    ) -> tuple[str, str] | None:  # fmt: skip
        """(cause, message) when the piece's bytes are not the `expected` bytes of `rows`."""

    @abstractmethod
    def install(
        self, kinds: list[CacheKind], pages: list[int], slot: int, start: int, end: int,
        prompt_len: int, resume_rows: bool, payload: memoryview | None,
    ) -> None:  # fmt: skip
        """Put a checked piece into decode's pools (nothing when it is there already)."""


class Backend(ABC):
    """One transfer backend: its frames, what decode offers prefill at the handshake, the link
    prefill makes of that offer, and the ways decode takes pieces in."""

    name: str
    transport: Transport

    def introduce(self) -> NixlAgent | None:
        """Prefill, in its Auth: what decode should know of this side's backend (nixl: its
        agent's name)."""
        return None

    def offer(self, kinds: list[CacheKind], conn: Connection, peer: Auth) -> dict:
        """Decode, once `peer` (prefill's Auth on `conn`) is authenticated: the fields of its
        answering Auth that say where prefill may write pieces (cuda_ipc: {"ipc": tensors};
        nixl: {"nixl": agent}; none: {})."""
        return {}

    def forget(self, conn: Connection) -> None:
        """Decode: a prefill's connection is gone (what `offer` kept of it goes)."""
        return

    @abstractmethod
    def link(self, offer: Auth, worker: WorkerSide) -> PieceLink:
        """Prefill, from decode's Auth: how pieces reach that peer; raises LinkError."""

    @abstractmethod
    def intakes(self, worker: WorkerSide) -> dict[bool, PieceIntake]:
        """Decode: the intake for each ChunkHeader.in_place value."""

    def close(self) -> None:
        """The agent closes: let go of what the backend holds beyond its transport."""
        return


def checksum_mismatch(h: ChunkHeader) -> str:
    return f"checksum mismatch on {h.kinds[0]}.. tokens [{h.token_start}, {h.token_end})"
