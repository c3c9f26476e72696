"""The PD protocol in isolation: state machines, deadlines, TCP framing, checksums."""

from __future__ import annotations

import queue
import socket
import threading

import pytest

from kvrelay.disagg import protocol as P
from kvrelay.disagg.protocol import InvalidTransition, TState
from kvrelay.disagg.transport.tcp import MAGIC, TcpTransport


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_prefill_machine_happy_path_and_deadlines():
    clock = FakeClock()
    sm = P.prefill_machine(bootstrap_s=5, prefill_s=50, send_s=7, clock=clock)
    assert sm.state == TState.BOOTSTRAPPING and sm.deadline == 105
    clock.t = 104.9
    assert not sm.expired()
    clock.t = 105.1
    assert sm.expired()
    sm.to(TState.PREFILLING)  # entering a state restarts its clock
    assert not sm.expired() and sm.deadline == pytest.approx(155.1)
    sm.to(TState.SENDING)
    assert sm.deadline == pytest.approx(112.1)
    sm.to(TState.DONE)
    assert sm.final and sm.deadline is None and not sm.expired(1e9)
    assert sm.history == [TState.BOOTSTRAPPING, TState.PREFILLING, TState.SENDING, TState.DONE]


@pytest.mark.parametrize(
    "path, bad",
    [
        ([], TState.SENDING),  # cannot skip the reservation
        ([], TState.DONE),
        ([TState.PREFILLING], TState.DONE),  # done only after sending
        ([TState.FAILED], TState.PREFILLING),  # final states are final
        ([TState.PREFILLING, TState.SENDING, TState.DONE], TState.FAILED),
    ],
)
def test_prefill_machine_rejects_invalid_transitions(path, bad):
    sm = P.prefill_machine(1, 1, 1)
    for s in path:
        sm.to(s)
    with pytest.raises(InvalidTransition):
        sm.to(bad)


def test_decode_machine():
    clock = FakeClock()
    sm = P.decode_machine(wait_s=3, receive_s=30, clock=clock)
    assert sm.state == TState.RESERVED and sm.deadline == 103
    with pytest.raises(InvalidTransition):
        sm.to(TState.DONE)  # nothing received yet
    sm.to(TState.RECEIVING)
    clock.t = 131
    assert sm.expired()
    sm.to(TState.FAILED)
    assert sm.final and not sm.expired()


def test_every_state_but_the_final_ones_has_a_timeout():
    for sm in (P.prefill_machine(1, 2, 3), P.decode_machine(1, 2)):
        for state, nxt in sm.transitions.items():
            assert (state in sm.timeouts_s) == bool(nxt), state


def test_messages_round_trip():
    msgs = [
        P.Hello("abc", "decode", "kv:L2"),
        P.ReserveRequest("t1", "r1", 17, P.prompt_hash([1, 2, 3])),
        P.ReserveAck("t1", False, "full"),
        P.ChunkHeader("t1", "r1", ["L0.k", "L0.v"], 0, 17, 1024, 12345),
        P.FirstToken("t1", "r1", 42, -0.5, [(42, -0.5), (7, -1.5)], 4),
        P.TransferDone("t1"),
        P.Failure("t1", P.Cause.CHECKSUM, "bad bytes"),
        P.Heartbeat("abc", 1.5),
    ]
    for m in msgs:
        assert P.decode(P.encode(m)) == m


def test_prompt_hash_tells_prompts_apart():
    assert P.prompt_hash([1, 2, 3]) == P.prompt_hash([1, 2, 3])
    assert P.prompt_hash([1, 2, 3]) != P.prompt_hash([1, 2, 4])
    assert P.prompt_hash([1, 2, 3]) != P.prompt_hash([1, 2, 3, 0])


@pytest.fixture
def tcp_pair():
    """A listening and a connecting TcpTransport; frames received on either side go to a queue.
    The connection's first frame stands in for the agents' handshake: the listener takes its
    peer as authenticated on it (before that, the listener's gate refuses any payload)."""
    server_rx: queue.Queue = queue.Queue()
    client_rx: queue.Queue = queue.Queue()
    closed: queue.Queue = queue.Queue()
    srv, cli = TcpTransport(max_payload=64 << 20), TcpTransport(max_payload=64 << 20)

    def on_server_message(c, h, p) -> None:
        if not c.is_authenticated:
            c.authenticated()
            return
        server_rx.put((c, h, bytes(p)))

    addr = srv.listen("127.0.0.1", 0, on_server_message, lambda c, r: closed.put(("server", r)))
    conn = cli.connect(
        addr,
        lambda c, h, p: client_rx.put((c, h, bytes(p))),
        lambda c, r: closed.put(("client", r)),
        timeout_s=5,
    )
    conn.send(P.encode(P.TransferDone("handshake")))
    yield addr, conn, server_rx, client_rx, closed
    cli.close()
    srv.close()


def test_tcp_framing_round_trip_both_ways(tcp_pair):
    _, conn, server_rx, client_rx, _ = tcp_pair
    big = bytes(range(256)) * 40_000  # 10 MB, several recv calls
    hdr = P.ChunkHeader("t", "r", ["L0.k"], 0, 1, len(big) + 3, P.checksum([big, b"xyz"]))
    conn.send(P.encode(hdr), [memoryview(big), b"xyz"])
    conn.send(P.encode(P.TransferDone("t")))  # no payload
    sconn, h1, p1 = server_rx.get(timeout=10)
    _, h2, p2 = server_rx.get(timeout=10)
    got = P.decode(h1)
    assert got == hdr and p1 == big + b"xyz" and P.checksum([p1]) == got.checksum
    assert P.decode(h2) == P.TransferDone("t") and p2 == b""
    sconn.send(
        P.encode(P.ReserveAck("t", True))
    )  # the accepted side answers on the same connection
    _, h3, _ = client_rx.get(timeout=10)
    assert P.decode(h3) == P.ReserveAck("t", True)


def test_checksum_detects_a_flipped_byte(tcp_pair):
    _, conn, server_rx, _, _ = tcp_pair
    data = bytearray(b"\x01" * 4096)
    hdr = P.ChunkHeader("t", "r", ["L0.k"], 0, 1, len(data), P.checksum([data]))
    data[1234] ^= 0x10  # corrupted after the checksum was taken
    conn.send(P.encode(hdr), [data])
    _, h, payload = server_rx.get(timeout=10)
    assert P.checksum([payload]) != P.decode(h).checksum


def test_bad_frame_closes_the_connection(tcp_pair):
    addr, _, server_rx, _, closed = tcp_pair
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"NOPE" + b"\x00" * 12)
        side, reason = closed.get(timeout=10)
    assert side == "server" and "magic" in reason
    assert server_rx.empty()
    assert MAGIC == b"KVR1"


def test_send_after_peer_closed_raises(tcp_pair):
    _, conn, _, _, closed = tcp_pair
    conn.close()
    assert conn.closed
    with pytest.raises(ConnectionError):
        conn.send(P.encode(P.TransferDone("t")))


def test_concurrent_senders_do_not_interleave_frames(tcp_pair):
    _, conn, server_rx, _, _ = tcp_pair
    payloads = {i: bytes([i]) * 200_000 for i in range(8)}

    def send(i):
        conn.send(P.encode(P.Failure(str(i), "x", "y")), [payloads[i]])

    threads = [threading.Thread(target=send, args=(i,)) for i in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in payloads:
        _, h, p = server_rx.get(timeout=10)
        assert p == payloads[int(P.decode(h).transfer_id)]


def test_texts_built_here_stay_within_the_wire_limits():
    long = "x" * (P.MAX_TEXT + 100)
    for msg in (P.Failure("t", P.Cause.PEER_FAILED, long), P.ReserveAck("t", False, long)):
        assert P.decode(P.encode(msg)) == msg  # truncated on construction, accepted on receipt
