"""The transfer handshake keeps out peers without the PD secret, and a peer's frames are sized
before anything is allocated for them (real engines, real TCP; the odd peer is a raw socket).

Each refusal names its cause on the side that sees it (a failed request's cause, a bootstrap
event, a log line), and a bad or silent decode address is a connect failure, nothing else.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time

import pytest
from engine_pair import PARAMS, PD_SECRET, pairs
from engine_pair import dense_engine as engine
from fake_peer import FakeDecode, FakePeer, authenticate_as_prefill, hello

from kvrelay.disagg import handshake as H
from kvrelay.disagg import protocol as P
from kvrelay.disagg.layout import max_piece_bytes
from kvrelay.engine.messages import AddRequest

IDS = [(3 * j) % 1000 + 10 for j in range(40)]


@pytest.fixture(scope="module")
def decode():
    """One decode engine for the raw-socket tests (none of them reserves anything)."""
    e = engine("decode")
    yield e
    e.agent.close()


@pytest.fixture(scope="module")
def prefill():
    """One prefill engine whose requests all fail before prefill computes anything."""
    e = engine("prefill", connect_timeout_s=1.0)
    yield e
    e.agent.close()


def _prefill_alone(p, rid: str, addr: str):
    """A PD request on a prefill engine whose decode peer is `addr`; its (failed) output."""
    p.add(AddRequest(rid, IDS, PARAMS, P.PDParams("prefill", f"t-{rid}", addr)))
    deadline = time.time() + 20
    while time.time() < deadline:
        p.poll_transfers()
        for o in p.step().outputs if p.has_work else []:
            if o.rid == rid and o.finish_reason:
                p.flush_prefix_cache()  # what the prefix cache alone holds
                assert p.scheduler.page_pool.num_used == 0
                return o
        time.sleep(0.01)
    raise AssertionError(f"{rid}: no output")


def _refused(caplog, cause: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvrelay.disagg"
        and "transfer peer refused" in r.getMessage()
        and f"cause={cause}" in r.getMessage()
    ]


def test_prefill_with_another_secret_is_refused_by_decode(caplog):
    caplog.set_level(logging.WARNING, "kvrelay.disagg")
    with pairs() as make:
        pr = make(engine("prefill", pd_secret="not-the-secret"), engine("decode"))
        pr.submit("w1", IDS, send_decode=False)
        pr.pump(lambda: pr.finished("prefill", "w1"))
        o = pr.last("prefill", "w1")
        assert o.cause == P.Cause.UNAUTHENTICATED and "failed to prove" in o.error, o.error
        assert pr.d.agent.bootstrap_counts == {"peer_unauthenticated": 1}
        assert pr.p.agent.bootstrap_counts == {"peer_unauthenticated": 1}
        assert _refused(caplog, P.Cause.UNAUTHENTICATED)
        pr.assert_clean()


def test_decode_without_a_secret_refuses_every_peer():
    with pairs() as make:
        pr = make(engine("prefill"), engine("decode", pd_secret=""))
        pr.submit("n1", IDS, send_decode=False)
        pr.pump(lambda: pr.finished("prefill", "n1"))
        o = pr.last("prefill", "n1")
        assert o.cause == P.Cause.UNAUTHENTICATED and "has no PD secret" in o.error, o.error
        pr.assert_clean()


def test_an_impostor_decode_is_refused_by_prefill(prefill, caplog):
    """A listener that plays decode without the secret: its proof is wrong, prefill hangs up
    before it sends a reservation (or anything else)."""
    caplog.set_level(logging.WARNING, "kvrelay.disagg")

    def script(peer: FakePeer, prefill_hello) -> None:
        assert isinstance(prefill_hello, P.Hello) and len(prefill_hello.nonce) == H.NONCE_BYTES
        peer.send(hello(prefill, "decode"))
        assert isinstance(peer.recv(), P.Auth)  # prefill proves itself first
        peer.send(P.Auth(secrets.token_bytes(32)))

    fake = FakeDecode(script)
    o = _prefill_alone(prefill, "i1", fake.addr)
    fake.join()
    assert fake.error is None and fake.received == []
    assert o.cause == P.Cause.UNAUTHENTICATED and "failed to prove" in o.error, o.error
    assert _refused(caplog, P.Cause.UNAUTHENTICATED)


def test_a_replayed_proof_is_worthless(decode):
    """A proof recorded on one connection fails on the next: decode's nonce is fresh each time."""
    first = FakePeer.connect(decode.agent.addr)
    mine = hello(decode, "prefill")
    first.send(mine)
    theirs = first.recv()
    ids = (mine.nonce, theirs.nonce, mine.instance_id, theirs.instance_id)
    proof = H.proof(PD_SECRET, "prefill", *ids)
    first.send(P.Auth(proof))
    assert isinstance(first.recv(), P.Auth)
    first.close()
    second = FakePeer.connect(decode.agent.addr)
    second.send(mine)  # the same hello, the same (now stale) proof
    assert isinstance(second.recv(), P.Hello)
    second.send(P.Auth(proof))
    refusal = second.recv()
    assert isinstance(refusal, P.Failure) and refusal.cause == P.Cause.UNAUTHENTICATED
    assert second.hung_up()


def test_nothing_but_the_handshake_before_it_and_no_payload(decode):
    """Before the handshake a frame may carry no payload: one announcing a terabyte is refused
    from its prefix (the terabyte is never sent, never allocated); a message that is not part
    of the handshake closes the connection; an old-protocol hello (the previous version: its
    acks would ask for other rows) is refused by name."""
    peer = FakePeer.connect(decode.agent.addr)
    peer.send(P.ChunkHeader("t", "r", ["L0.k"], 0, 1, 1 << 40, None), announce=1 << 40)
    assert peer.hung_up()

    peer = FakePeer.connect(decode.agent.addr)
    peer.send(P.ReserveRequest("t-x", "x", 40, P.prompt_hash(IDS)))
    assert peer.hung_up()
    assert not decode.agent.orphans

    peer = FakePeer.connect(decode.agent.addr)
    peer.send(hello(decode, "prefill", nonce=b"", version=P.PROTOCOL_VERSION - 1))
    refusal = peer.recv()
    assert isinstance(refusal, P.Failure) and refusal.cause == P.Cause.PROTOCOL, refusal
    assert peer.hung_up()


def test_an_authenticated_peer_may_announce_one_piece_at_most(decode):
    limit = decode.agent.max_payload
    assert limit == max_piece_bytes(decode.agent.kinds, decode.max_model_len)
    assert 0 < limit < 64 << 20  # the whole context of the tiny model, not "anything"
    peer = FakePeer.connect(decode.agent.addr)
    authenticate_as_prefill(peer, decode, PD_SECRET)
    peer.send(P.ChunkHeader("t", "r", ["L0.k"], 0, 1, limit + 1, None), announce=limit + 1)
    assert peer.hung_up()


def test_a_bad_or_silent_decode_address_is_a_connect_failure(prefill):
    o = _prefill_alone(prefill, "b1", "no-port-here")
    assert o.cause == P.Cause.CONNECT and "host:port" in o.error, o.error
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        o = _prefill_alone(prefill, "b2", f"127.0.0.1:{silent.getsockname()[1]}")
    assert o.cause == P.Cause.CONNECT and "did not complete the handshake" in o.error, o.error


def test_dialing_a_silent_decode_does_not_stall_the_engine():
    """Connect and handshake run on a dial thread: add() returns with the PD request still
    bootstrapping (it used to block until the handshake deadline), the same prefill engine
    serves a plain request to the end while that dial hangs, and the PD request then fails as a
    connect failure when the silent decode goes away."""
    p = engine("prefill", connect_timeout_s=60.0)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        addr = f"127.0.0.1:{silent.getsockname()[1]}"
        p.add(AddRequest("pd", IDS, PARAMS, P.PDParams("prefill", "t-pd", addr)))
        t = p.agent.transfers["pd"]  # not failed, not blocked: waiting for its dial
        assert t.peer is None and not t.sm.final
        p.add(AddRequest("plain", IDS, PARAMS, None))
        done: dict[str, object] = {}
        deadline = time.time() + 120
        while "pd" not in done:
            assert time.time() < deadline, done
            if "plain" in done and silent.fileno() != -1:
                silent.close()  # the dial's connection is reset: its handshake fails now
            p.poll_transfers()
            for o in p.step().outputs if p.has_work else []:
                if o.finish_reason:
                    assert o.rid != "pd" or "plain" in done  # the plain one did not wait
                    done[o.rid] = o
            time.sleep(0.005)
        assert done["plain"].error is None and len(done["plain"].token_ids) > 0
        assert done["pd"].cause == P.Cause.CONNECT, done["pd"].error
        p.flush_prefix_cache()  # what the prefix cache alone holds
        assert p.scheduler.page_pool.num_used == 0
    finally:
        silent.close()
        p.agent.close()
