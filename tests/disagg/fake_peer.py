"""A hand-driven PD transfer peer on a raw socket: frames built byte by byte, so that a test can
send what a real agent never would (a crafted hello, a wrong proof, a huge announced payload)."""

from __future__ import annotations

import socket
import threading

from kvrelay.disagg import handshake as H
from kvrelay.disagg import protocol as P
from kvrelay.disagg.transport.tcp import _PREFIX, MAGIC, parse_addr


class FakePeer:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.settimeout(10)

    @classmethod
    def connect(cls, addr: str) -> FakePeer:
        return cls(socket.create_connection(parse_addr(addr), timeout=10))

    def send(self, msg, payload: bytes = b"", announce: int | None = None) -> None:
        """Send one frame: `msg` a message or raw header bytes; `announce` a payload length other
        than the real one (only the real payload is sent)."""
        header = msg if isinstance(msg, bytes) else P.encode(msg)
        n = len(payload) if announce is None else announce
        self.sock.sendall(_PREFIX.pack(MAGIC, len(header), n) + header + payload)

    def recv(self) -> P.Message | None:
        """The next message but heartbeats; None when the other side hung up."""
        while True:
            prefix = self._exact(_PREFIX.size)
            if prefix is None:
                return None
            _, hlen, plen = _PREFIX.unpack(prefix)
            header = self._exact(hlen)
            if header is None or (plen and self._exact(plen) is None):
                return None
            msg = P.decode(header)
            if not isinstance(msg, P.Heartbeat):
                return msg

    def hung_up(self) -> bool:
        """Whether the other side closes the connection (within the socket timeout), whatever
        it says before."""
        try:
            while self.recv() is not None:
                pass
            return True
        except TimeoutError:
            return False

    def _exact(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()


def hello(engine, role: str, nonce: bytes | None = None, **kw) -> P.Hello:
    """A hello that matches `engine`'s cache layout, from a peer of `role`."""
    agent = engine.agent
    return P.Hello(
        "fake-" + role,
        role,
        agent.layout,
        H.new_nonce() if nonce is None else nonce,
        description=agent.layout_lines,
        **kw,
    )


def authenticate_as_prefill(peer: FakePeer, decode, secret: str) -> P.Auth:
    """The whole handshake against a real decode engine, as a prefill holding `secret`; returns
    decode's Auth after checking its proof."""
    mine = hello(decode, "prefill")
    peer.send(mine)
    theirs = peer.recv()
    assert isinstance(theirs, P.Hello), theirs
    args = (mine.nonce, theirs.nonce, mine.instance_id, theirs.instance_id)
    peer.send(P.Auth(H.proof(secret, "prefill", *args)))
    auth = peer.recv()
    assert isinstance(auth, P.Auth), auth
    assert H.proof_ok(H.proof(secret, "decode", *args), auth.proof)
    return auth


class FakeDecode:
    """A listener that answers one prefill connection with `script(peer, prefill_hello)`."""

    def __init__(self, script) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.received: list = []  # what prefill sent after its hello
        self.error: BaseException | None = None
        self._script = script
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        peer = None
        try:
            sock, _ = self.srv.accept()
            peer = FakePeer(sock)
            first = peer.recv()
            self._script(peer, first)
            while (msg := peer.recv()) is not None:
                self.received.append(msg)
        except BaseException as e:  # the test asserts there was none
            self.error = e
        finally:
            if peer is not None:
                peer.close()

    def join(self) -> None:
        self._thread.join(timeout=15)
        self.srv.close()
