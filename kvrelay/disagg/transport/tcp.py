"""TCP backend: works everywhere (the CPU tests use it). One reader thread per connection.

Frame: magic b"KVR1", header length (u32), payload length (u64), header bytes, payload bytes.
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
MAX_HEADER = 1 << 20


class FramingError(ConnectionError):
    pass


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


def read_frame(sock: socket.socket) -> tuple[bytes, memoryview]:
    magic, hlen, plen = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size))
    if magic != MAGIC:
        raise FramingError(f"bad frame magic {bytes(magic)!r}")
    if hlen > MAX_HEADER:
        raise FramingError(f"frame header of {hlen} bytes is too large")
    header = bytes(_recv_exact(sock, hlen))
    payload = memoryview(_recv_exact(sock, plen)) if plen else memoryview(b"")
    return header, payload


class TcpConnection(Connection):
    def __init__(
        self, sock: socket.socket, peer: str, on_message: OnMessage, on_close: OnClose
    ) -> None:
        self.sock, self.peer = sock, peer
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
                header, payload = read_frame(self.sock)
                self._on_message(self, header, payload)
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


class TcpTransport(Transport):
    def __init__(self) -> None:
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
                self._conns.append(TcpConnection(sock, f"{h}:{p}", on_message, on_close))

    def connect(
        self, addr: str, on_message: OnMessage, on_close: OnClose, timeout_s: float
    ) -> Connection:
        host, port = addr.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        sock.settimeout(None)
        conn = TcpConnection(sock, addr, on_message, on_close)
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
