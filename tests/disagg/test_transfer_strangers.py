"""Strangers at the transfer listener (any process that can reach decode's port): what they can
cost is bounded in count, time and threads, they are refused and counted, and PD keeps serving.
Real engines, real sockets; the listener out of descriptors is a real RLIMIT_NOFILE in a child.

Bounds here: the gate's cap and deadline are lowered on the live listener (16 waiting peers,
0.5 s), so that every flood connection ends within a second of its start whatever the load.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

from engine_pair import PD_SECRET, Pair, pairs
from engine_pair import dense_engine as engine
from fake_peer import FakePeer, hello

from kvrelay.disagg import handshake as H
from kvrelay.disagg import protocol as P
from kvrelay.disagg.transport.tcp import _PREFIX, MAGIC, parse_addr

IDS = [(7 * j) % 900 + 11 for j in range(40)]
STRANGER_EVENTS = ("stranger_refused", "stranger_garbage", "handshake_timeout")


def _tighten(decode, cap: int = 16, deadline_s: float = 0.5) -> None:
    gate = decode.agent.transport.gate
    gate.max_pending, gate.handshake_deadline_s = cap, deadline_s


def _serve(pr: Pair, rids: list[str]) -> None:
    for rid in rids:
        pr.submit(rid, IDS)
    pr.pump(lambda: all(pr.finished("decode", r) for r in rids), timeout=30)
    for rid in rids:
        last = pr.last("decode", rid)
        assert last.finish_reason == "length" and last.error is None, (rid, last)


def _flood(addr: str, idle: int, garbage: int, hold_s: float) -> list[socket.socket]:
    """`garbage` connections that send a bad frame, then `idle` ones that say nothing, held
    `hold_s` (past the deadline) and then closed."""
    socks = []
    for i in range(idle + garbage):
        s = socket.create_connection(parse_addr(addr), timeout=5)
        if i < garbage:
            s.sendall(b"GARBAGE!" + os.urandom(24))
        socks.append(s)
    time.sleep(hold_s)
    for s in socks:
        s.close()
    return socks


def _stranger_counts(decode) -> dict[str, int]:
    events = decode.agent.take_stats()[1]
    return {k: events.get(k, 0) for k in STRANGER_EVENTS}


def test_a_flood_is_refused_and_counted_while_pd_keeps_serving():
    """300 idle and 100 garbage connections against a serving decode: no thread each, every one
    refused (past the cap), dropped at the deadline, or closed as garbage, and counted; PD serves
    on its authenticated connection all along, and a prefill that dials afterwards pairs."""
    with pairs() as make:
        pr = make(engine("prefill"), engine("decode"))
        _serve(pr, ["warm"])  # prefill's connection is authenticated before the flood
        _tighten(pr.d)
        threads_before = threading.active_count()
        n_idle, n_garbage = 300, 100
        flood = threading.Thread(target=_flood, args=(pr.d.agent.addr, n_idle, n_garbage, 1.5))
        t0 = time.monotonic()
        flood.start()
        time.sleep(0.05)
        peak_threads = threading.active_count()
        _serve(pr, [f"during{i}" for i in range(4)])
        peak_threads = max(peak_threads, threading.active_count())
        flood.join(timeout=20)
        assert not flood.is_alive()
        deadline = time.monotonic() + 5
        while sum(_stranger_counts(pr.d).values()) < n_idle + n_garbage:
            assert time.monotonic() < deadline, _stranger_counts(pr.d)
            time.sleep(0.05)
        counts = _stranger_counts(pr.d)
        assert sum(counts.values()) == n_idle + n_garbage, counts  # each exactly once
        assert counts["stranger_refused"] > 0 and counts["handshake_timeout"] > 0, counts
        assert counts["stranger_garbage"] > 0, counts
        assert pr.d.agent.transport.gate.pending == 0
        assert peak_threads - threads_before <= 2, (threads_before, peak_threads)  # the flooder
        assert time.monotonic() - t0 < 15
        events = pr.d.agent.take_stats()[1]
        assert events.get("peer_unauthenticated", 0) == 0  # garbage is not a failed handshake
        pr.assert_clean()
        # The sequel: a prefill that (re)starts after the flood pairs and serves.
        again = make(engine("prefill"), pr.d)
        _serve(again, ["after"])
        assert again.p.agent.take_stats()[1].get("peer_connected") == 1
        again.assert_clean()


def test_nothing_but_the_challenge_before_authentication():
    """Before a peer proves it holds the secret, decode sends it one frame: a hello with its
    nonce, prefill's own layout fingerprint echoed and no layout description (nothing of
    decode's cache); no heartbeat, however long the peer waits; a heartbeat from the peer
    closes the connection; an unauthenticated peer is dropped at the handshake deadline."""
    with pairs() as make:
        d = make(engine("prefill"), engine("decode", heartbeat_interval_s=0.1)).d
        _tighten(d, deadline_s=1.0)
        peer = FakePeer.connect(d.agent.addr)
        mine = P.Hello("fake-prefill", "prefill", "f" * 16, H.new_nonce(), description=["x"])
        peer.send(mine)
        frames = _raw_frames(peer.sock, 1.5)  # past 10 heartbeat intervals, and the deadline
        assert len(frames) == 1, frames
        challenge = P.decode(frames[0])
        assert isinstance(challenge, P.Hello) and len(challenge.nonce) == H.NONCE_BYTES
        assert challenge.layout == mine.layout != d.agent.layout  # ours echoed, not decode's
        assert challenge.description == []
        assert d.agent.take_stats()[1].get("handshake_timeout") == 1

        peer = FakePeer.connect(d.agent.addr)
        peer.send(P.Heartbeat("fake-prefill", time.time()))
        assert peer.hung_up()
        assert d.agent.take_stats()[1].get("peer_unauthenticated") == 1


def test_undecodable_hellos_are_counted_each_and_logged_sparingly(caplog):
    """100 strangers each sending one well-framed but undecodable header: each closed and
    counted (stranger_bad_message), and decode's log gets a line per second, not one each."""
    caplog.set_level(logging.WARNING, "kvrelay.disagg")
    with pairs() as make:
        d = make(engine("prefill"), engine("decode")).d
        t0 = time.monotonic()
        for _ in range(100):
            peer = FakePeer.connect(d.agent.addr)
            peer.send(b"\xc1 not msgpack")
            assert peer.hung_up()
        took = time.monotonic() - t0
        assert d.agent.take_stats()[1].get("stranger_bad_message") == 100
        lines = [r for r in caplog.records if "cause=bad_message" in r.getMessage()]
        assert 1 <= len(lines) <= took + 2, (len(lines), took)


def test_a_layout_difference_is_named_only_to_a_peer_that_proved_itself():
    with pairs() as make:
        d = make(engine("prefill"), engine("decode")).d
        peer = FakePeer.connect(d.agent.addr)
        mine = hello(d, "prefill")
        mine.layout, mine.description = "0" * 16, ["page_size=99"]
        peer.send(mine)
        theirs = peer.recv()
        ids = (mine.nonce, theirs.nonce, mine.instance_id, theirs.instance_id)
        peer.send(P.Auth(H.proof(PD_SECRET, "prefill", *ids)))
        refusal = peer.recv()
        assert isinstance(refusal, P.Failure) and refusal.cause == P.Cause.LAYOUT, refusal
        assert "page_size" in refusal.message
        assert peer.hung_up()


def _raw_frames(sock: socket.socket, within_s: float) -> list[bytes]:
    """Every frame header the other side sends within `within_s` (heartbeats included)."""
    sock.settimeout(0.1)
    buf, end = b"", time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            break
        buf += chunk
    frames = []
    while len(buf) >= _PREFIX.size:
        magic, hlen, plen = _PREFIX.unpack(buf[: _PREFIX.size])
        assert magic == MAGIC
        frames.append(buf[_PREFIX.size : _PREFIX.size + hlen])
        buf = buf[_PREFIX.size + hlen + plen :]
    return frames


CHILD = r"""
import json, os, resource, sys
import kvrelay.disagg.transport.tcp as tcp
tcp.MAX_PENDING, tcp.HANDSHAKE_DEADLINE_S = 10_000, 60.0
t = tcp.TcpTransport()
def on_message(conn, header, payload):
    if header == b"auth":
        conn.authenticated()
        conn.send(b"welcome")
    elif header == b"stats":
        conn.send(json.dumps(t.listener_counts()).encode())
addr = t.listen("127.0.0.1", 0, on_message, lambda conn, reason: None)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 30, hard))
print(addr, flush=True)
sys.stdin.read()
"""


def _frame(header: bytes) -> bytes:
    return _PREFIX.pack(MAGIC, len(header), 0) + header


def _ask(addr: str, *headers: bytes) -> bytes:
    """Send `headers` as frames on a fresh connection; the last answer's header."""
    with socket.create_connection(parse_addr(addr), timeout=5) as s:
        reply = b""
        for h in headers:
            s.sendall(_frame(h))
            prefix = _exact(s, _PREFIX.size)
            reply = _exact(s, _PREFIX.unpack(prefix)[1])
        return reply


def _exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "the listener hung up"
        buf += chunk
    return buf


def test_the_accept_loop_survives_running_out_of_descriptors():
    """A listener whose process may open 30 more descriptors gets 120 connections that hold
    theirs: accept() fails with EMFILE, is counted, the waiting peers are shed (closed, not left
    in a full backlog), and once the connections close the listener serves a new peer."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        addr = child.stdout.readline().strip()
        assert _ask(addr, b"auth") == b"welcome"
        held = [socket.create_connection(parse_addr(addr), timeout=5) for _ in range(120)]
        time.sleep(0.5)  # the child accepts until it runs out
        for s in held:
            s.close()
        deadline, reply = time.monotonic() + 10, None
        while time.monotonic() < deadline:  # the listener backs off at most 1 s at a time
            try:
                reply = _ask(addr, b"auth", b"stats")
                break
            except (OSError, AssertionError):
                time.sleep(0.2)
        assert reply is not None, "the listener never accepted again"
        counts = json.loads(reply)
        assert counts["accept_failed"] >= 1 and counts["accept_shed"] >= 1, counts
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
