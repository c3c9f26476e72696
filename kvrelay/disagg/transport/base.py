"""The transfer-backend interface: framed messages (header bytes + payload buffers) between peers.

The protocol layer above never sees sockets and the backend never sees tensors: a header is opaque
bytes, a payload is a sequence of bytes-like buffers. A backend that moves payloads another way
(NIXL writing into registered device memory) keeps this surface: headers still travel as frames,
and `send` delivers the payload however the backend can.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

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
