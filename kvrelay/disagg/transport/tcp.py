"""TCP backend: works everywhere (the CPU tests use it). One reader thread per connection.

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

log = logging.getLogger("kvrelay.disagg.tcp")

MAGIC = b"KVR1"
_PREFIX = struct.Struct("!4sIQ")
MAX_HEADER = 1 << 20  # the largest header (ReserveAck of a 1M-token prompt: ~330 kB)


class FramingError(ConnectionError):
    """A frame this side refuses; `cause` names why (the log line and the close reason say it)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(f"{cause}: {message}")
        self.cause = cause


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


def read_frame(
    sock: socket.socket, max_payload: int, max_header: int = MAX_HEADER
) -> tuple[bytes, memoryview]:
    magic, hlen, plen = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size))
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
    ) -> None:
        self.sock, self.peer, self.max_payload = sock, peer, max_payload
        self._on_message, self._on_close = on_message, on_close
        self._lock = threading.Lock()
        self._closed = False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"kvrelay-tcp-{peer}")
        self._reader.start()

    @property
    def closed(self) -> bool:
        return self._closed

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
                self._shutdown(f"send failed: {e}")
                raise ConnectionError(f"send to {self.peer} failed: {e}") from e

    def _read(self) -> None:
        reason = "closed"
        try:
            while True:
                header, payload = read_frame(self.sock, self.max_payload)
                self._on_message(self, header, payload)
        except FramingError as e:
            log.warning("frame refused peer=%s cause=%s message=%s", self.peer, e.cause, e)
            reason = str(e)
        except (OSError, ConnectionError) as e:
            reason = str(e) or type(e).__name__
        except Exception as e:  # a handler bug must not leave the peer hanging: drop the connection
            log.exception("tcp handler failed peer=%s", self.peer)
            reason = f"handler error: {type(e).__name__}: {e}"
        self._shutdown(reason)

    def _shutdown(self, reason: str) -> None:
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
        self._shutdown("closed locally")


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
        self._conns: list[TcpConnection] = []
        self._lock = threading.Lock()

    def listen(self, host: str, port: int, on_message: OnMessage, on_close: OnClose) -> str:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, port))
        srv.listen(64)
        self._server = srv
        threading.Thread(
            target=self._accept,
            args=(srv, on_message, on_close),
            daemon=True,
            name="kvrelay-tcp-accept",
        ).start()
        h, p = srv.getsockname()[:2]
        return f"{h}:{p}"

    def _accept(self, srv: socket.socket, on_message: OnMessage, on_close: OnClose) -> None:
        while True:
            try:
                sock, (h, p) = srv.accept()
            except OSError:
                return
            with self._lock:
                self._conns = [c for c in self._conns if not c.closed]  # refused peers go
                self._conns.append(
                    TcpConnection(sock, f"{h}:{p}", on_message, on_close, self.max_payload)
                )

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
        if self._server is not None:
            self._server.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            c.close()
