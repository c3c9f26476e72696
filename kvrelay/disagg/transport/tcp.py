"""TCP backend: works everywhere (the CPU tests use it). One reader thread per authenticated
connection (and per connection this side dialed); accepted connections go through the listener's
gate (gate.py: one thread, bounded count and time) until their peer has authenticated.

Frame: magic b"KVR1", header length (u32), payload length (u64), header bytes, payload bytes.
Both lengths are checked against the connection's limits before anything is allocated for them.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Sequence

from kvrelay.disagg.transport.base import Buffer, Connection, OnClose, OnMessage, Transport
from kvrelay.disagg.transport.gate import Gate

log = logging.getLogger("kvrelay.disagg.tcp")

MAGIC = b"KVR1"
_PREFIX = struct.Struct("!4sIQ")
MAX_HEADER = 1 << 20  # the largest header (ReserveAck of a 1M-token prompt: ~330 kB)
# Before authentication: a hello (its layout description: ~40 kB for DeepSeek-V4-Flash), no payload.
MAX_HANDSHAKE_HEADER = 256 << 10
MAX_PENDING = 64  # accepted connections in their handshake at once; past it, new ones are closed
HANDSHAKE_DEADLINE_S = 5.0  # from accept to authenticated, else closed


class FramingError(ConnectionError):
    """A frame this side refuses; `cause` names why (the log line and the close reason say it)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(f"{cause}: {message}")
        self.cause = cause


def _recv_exact(sock, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


def _check_prefix(prefix, max_payload: int, max_header: int) -> tuple[int, int]:
    magic, hlen, plen = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FramingError("bad_frame_magic", f"bad frame magic {bytes(magic)!r}")
    if hlen > max_header:
        raise FramingError(
            "frame_header_too_large", f"a {hlen}-byte frame header (limit {max_header})"
        )
    if plen > max_payload:
        raise FramingError(
            "frame_payload_too_large", f"a {plen}-byte frame payload (limit {max_payload})"
        )
    return hlen, plen


def handshake_frame(buf: bytearray) -> tuple[bytes, int] | None:
    """(header, bytes used) of the first whole frame of an unauthenticated peer's `buf` (None:
    not whole yet); refuses, from the prefix alone, any payload and a header over the limit."""
    if len(buf) < _PREFIX.size:
        return None
    hlen, _ = _check_prefix(bytes(buf[: _PREFIX.size]), 0, MAX_HANDSHAKE_HEADER)
    end = _PREFIX.size + hlen
    return (bytes(buf[_PREFIX.size : end]), end) if len(buf) >= end else None


class _Buffered:
    """A socket read through the bytes the gate had buffered beyond the handshake."""

    def __init__(self, sock: socket.socket, head: bytes = b"") -> None:
        self.sock, self.head = sock, head

    def recv_into(self, view: memoryview, n: int) -> int:
        if self.head:
            k = min(n, len(self.head))
            view[:k] = self.head[:k]
            self.head = self.head[k:]
            return k
        return self.sock.recv_into(view, n)


def read_frame(sock, max_payload: int, max_header: int = MAX_HEADER) -> tuple[bytes, memoryview]:
    hlen, plen = _check_prefix(_recv_exact(sock, _PREFIX.size), max_payload, max_header)
    header = bytes(_recv_exact(sock, hlen))
    payload = memoryview(_recv_exact(sock, plen)) if plen else memoryview(b"")
    return header, payload


class TcpConnection(Connection):
    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        on_message: OnMessage,
        on_close: OnClose,
        max_payload: int = 0,
        read: bool = True,
    ) -> None:
        """`read`: start the reader thread now (a dialed connection); else the gate delivers the
        handshake's frames and starts it once the peer authenticated."""
        self.sock, self.peer, self.max_payload = sock, peer, max_payload
        self._on_message, self._on_close = on_message, on_close
        self._lock = threading.Lock()
        self._closed = False
        self.is_authenticated = False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if read:
            self.start_reading()

    @property
    def closed(self) -> bool:
        return self._closed

    def deliver(self, header: bytes) -> None:
        """A handshake frame the gate read (no payload before authentication)."""
        self._on_message(self, header, memoryview(b""))

    def start_reading(self, head: bytes = b"") -> None:
        self.sock.settimeout(None)
        reader = _Buffered(self.sock, head)
        threading.Thread(
            target=self._read, args=(reader,), daemon=True, name=f"kvrelay-tcp-{self.peer}"
        ).start()

    def send(self, header: bytes, buffers: Sequence[Buffer] = ()) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        prefix = _PREFIX.pack(MAGIC, len(header), sum(v.nbytes for v in views))
        with self._lock:
            if self._closed:
                raise ConnectionError(f"connection to {self.peer} is closed")
            try:
                self.sock.sendall(prefix + header)
                for v in views:
                    self.sock.sendall(v)
            except OSError as e:
                self.shutdown(f"send failed: {e}")
                raise ConnectionError(f"send to {self.peer} failed: {e}") from e

    def _read(self, reader: _Buffered) -> None:
        reason = "closed"
        try:
            while True:
                header, payload = read_frame(reader, self.max_payload)
                self._on_message(self, header, payload)
        except FramingError as e:
            log.warning("frame refused peer=%s cause=%s message=%s", self.peer, e.cause, e)
            reason = str(e)
        except (OSError, ConnectionError) as e:
            reason = str(e) or type(e).__name__
        except Exception as e:  # a handler bug must not leave the peer hanging: drop the connection
            log.exception("tcp handler failed peer=%s", self.peer)
            reason = f"handler error: {type(e).__name__}: {e}"
        self.shutdown(reason)

    def shutdown(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._on_close(self, reason)

    def close(self) -> None:
        self.shutdown("closed locally")


def parse_addr(addr: str) -> tuple[str, int]:
    """Split "host:port"; a malformed address is a ConnectionError that names it."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConnectionError(f"{addr!r} is not a host:port address")
    return host.strip("[]"), int(port)


class TcpTransport(Transport):
    def __init__(self, max_payload: int = 0) -> None:
        self.max_payload = max_payload  # each new connection's limit until raised
        self._server: socket.socket | None = None
        self.gate: Gate | None = None
        self._conns: list[TcpConnection] = []
        self._lock = threading.Lock()

    def listen(self, host: str, port: int, on_message: OnMessage, on_close: OnClose) -> str:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, port))
        srv.listen(128)
        self._server = srv

        def make_conn(sock: socket.socket, peer: str) -> TcpConnection:
            conn = TcpConnection(sock, peer, on_message, on_close, self.max_payload, read=False)
            with self._lock:
                self._conns = [c for c in self._conns if not c.closed]  # refused peers go
                self._conns.append(conn)
            return conn

        self.gate = Gate(
            srv,
            make_conn,
            handshake_frame,
            MAX_PENDING,
            HANDSHAKE_DEADLINE_S,
            _PREFIX.size + MAX_HANDSHAKE_HEADER,
        )
        h, p = srv.getsockname()[:2]
        return f"{h}:{p}"

    def listener_counts(self) -> dict[str, int]:
        """The gate's events since start (accepted, stranger_refused, handshake_timeout, ...)."""
        return self.gate.take_counts() if self.gate is not None else {}

    def connect(
        self, addr: str, on_message: OnMessage, on_close: OnClose, timeout_s: float
    ) -> Connection:
        sock = socket.create_connection(parse_addr(addr), timeout=timeout_s)
        sock.settimeout(None)
        conn = TcpConnection(sock, addr, on_message, on_close, self.max_payload)
        with self._lock:
            self._conns.append(conn)
        return conn

    def close(self) -> None:
        if self.gate is not None:
            self.gate.close()
        if self._server is not None:
            self._server.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            c.close()
