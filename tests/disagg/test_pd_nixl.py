"""PD over the nixl transfer backend (NIXL with UCX, host memory on CPU): prefill writes every
piece straight into decode's registered pages and notifies it; headers still go over the
authenticated TCP connection.

Engines in one process (two NIXL agents, real UCX between them): PD == a single engine token
for token (dense and DeepSeek-V4, every cache kind, at concurrency 1 and 16); the fault paths the
tcp backend has (a damaged piece, a missing notification, an abort, a late transfer, a lost
peer) end with an error naming the cause on both sides and every page and slot back; a nixl side
paired with a tcp one frames its pieces. Strangers: a peer without the PD secret never gets
decode to take its NIXL agent (nor gets decode's metadata), a changed NIXL field breaks the proof,
notifications from an agent no authenticated connection named are dropped.
Real servers (one SmolLM2 stack): PD through the router == the single server at concurrency 1
and 16, bytes counted under nixl, a stranger at the real transfer port refused, then decode and
prefill each SIGKILLed mid-transfer (errors within the bound, nothing held) and restarted alone
(a new NIXL agent, metadata exchanged again; the next 32 requests succeed).
"""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import ServerProcess, free_port
from engine_pair import PARAMS, PD_SECRET, dense_engine, dsv4_engine, pairs
from fake_peer import FakeDecode, FakePeer, hello
from openai_calls import assert_same_outputs, client, run_spec, run_specs
from pd_stack import PDStack, bootstrap_events, engine_threads, metrics
from test_pd_dsv4 import _specs as dsv4_specs
from test_pd_lost_peers import (
    BOOTSTRAP,
    _check_failures,
    _in_flight_then,
    _new_failures,
    _restart_alone,
    _transfers,
)
from test_transfer_auth import _prefill_alone

from kvrelay.disagg import handshake as H
from kvrelay.disagg import protocol as P
from kvrelay.disagg.protocol import Cause
from kvrelay.disagg.transport import nixl as N
from kvrelay.disagg.transport.framed import FramedLink
from kvrelay.engine.engine import generate
from kvrelay.engine.messages import SamplingParams

pytest.importorskip(
    "nixl_cu13", reason="NIXL is not installed (pip install 'kvrelay[nixl]'): nixl backend untested"
)

NIXL = {"transfer_backend": "nixl"}


def dense(role: str, **kw):
    return dense_engine(role, **{**NIXL, **kw})


def dsv4(role: str, **kw):
    return dsv4_engine(role, **{**NIXL, **kw})


def _prompts(lengths) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 1000 + 10 for j in range(n)] for i, n in enumerate(lengths)]


@pytest.fixture
def make_pair():
    with pairs() as make:
        yield make


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def _run(pr, prompts, params=PARAMS, prefix: str = "r", timeout: float = 60) -> list[str]:
    rids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts, strict=True):
        pr.submit(rid, ids, params)
    pr.pump(
        lambda: all(pr.finished("decode", r) and pr.finished("prefill", r) for r in rids), timeout
    )
    return rids


def _same(pr, rids, want) -> None:
    for rid, w in zip(rids, want, strict=True):
        got = pr.outs[("decode", rid)]
        assert _tokens(got) == _tokens(w), rid
        lp_got, lp_want = [x for o in got for x in o.logprobs], [x for o in w for x in o.logprobs]
        assert lp_got == pytest.approx(lp_want, abs=1e-4), rid
        assert got[-1].finish_reason == "length" and got[-1].error is None, rid
        assert pr.last("prefill", rid).finish_reason == "transferred"


def _failed(pr, rid: str, side: str, cause: str) -> None:
    o = pr.last(side, rid)
    assert o.finish_reason == "error" and o.cause == cause, (side, o)


def _clean(pr) -> None:
    pr.assert_clean()
    for e in (pr.p, pr.d):
        assert e.scheduler.slot_pool is None or e.scheduler.slot_pool.num_used == 0


# -- dense engines in one process ---------------------------------------------------------------


def test_pd_over_nixl_equals_single_engine_at_concurrency_1_and_16(make_pair):
    single = dense("single")
    alone = _prompts([70])
    many = _prompts([5, 16, 17, 33, 70, 100, 9, 31, 48, 64, 12, 90, 21, 40, 3, 77])
    want_alone, want_many = generate(single, alone, PARAMS), generate(single, many, PARAMS)
    pr = make_pair(dense("prefill"), dense("decode"))
    _same(pr, _run(pr, alone, prefix="a"), want_alone)
    assert isinstance(pr.p.agent.peers[pr.d.agent.addr].link, N.NixlLink)
    _same(pr, _run(pr, many, prefix="m"), want_many)
    _clean(pr)
    # Every prompt's KV went through NIXL, counted under nixl on both sides (and nothing framed).
    moved = sum(map(len, alone + many)) * sum(k.row_bytes for k in pr.d.agent.kinds)
    assert pr.p.agent.take_stats()[0] == {"sent": {"nixl": moved}}
    assert pr.d.agent.take_stats()[0] == {"installed": {"nixl": moved}}
    assert pr.d.agent.backend.agent.dropped == 0  # every notification came from its peer


def test_a_piece_damaged_on_its_way_is_a_checksum_error(make_pair):
    pr = make_pair(dense("prefill", test_corrupt_p=1.0), dense("decode"))
    pr.submit("c1", _prompts([70])[0])
    pr.pump(lambda: pr.finished("decode", "c1") and pr.finished("prefill", "c1"))
    _failed(pr, "c1", "decode", Cause.CHECKSUM)
    _failed(pr, "c1", "prefill", Cause.CHECKSUM)  # decode's failure names the cause
    assert all(not o.token_ids for o in pr.outs[("decode", "c1")])
    _clean(pr)


def test_checksum_off_is_honoured_on_both_sides(make_pair):
    pr = make_pair(dense("prefill", checksum=False), dense("decode", checksum=False))
    pr.submit("n1", _prompts([33])[0])
    pr.pump(lambda: pr.finished("decode", "n1") and pr.finished("prefill", "n1"))
    assert pr.last("decode", "n1").finish_reason == "length"
    _clean(pr)


def test_a_piece_without_its_notification_is_a_timeout_not_a_hang(make_pair, monkeypatch):
    """A header whose write never announced itself: decode waits NOTIF_WAIT_S for the
    notification, then fails the transfer (never reads rows that may not have landed)."""
    monkeypatch.setattr(N, "NOTIF_WAIT_S", 0.3)
    pr = make_pair(dense("prefill"), dense("decode"))
    pr.submit("w", _prompts([17])[0])  # the peer exists (its link) from now on
    pr.pump(lambda: pr.finished("decode", "w") and pr.finished("prefill", "w"))
    agent = pr.p.agent.peers[pr.d.agent.addr].link.agent
    write = agent.write
    monkeypatch.setattr(
        agent, "write", lambda peer, lo, ro, mems, tag: write(peer, lo, ro, mems, b"")
    )
    began = time.time()
    pr.submit("q1", _prompts([40])[0])
    pr.pump(lambda: pr.finished("decode", "q1") and pr.finished("prefill", "q1"))
    assert time.time() - began < 10
    _failed(pr, "q1", "decode", Cause.TIMEOUT)
    _failed(pr, "q1", "prefill", Cause.TIMEOUT)
    assert "no NIXL notification" in pr.last("decode", "q1").error
    _clean(pr)


def test_abort_on_decode_while_receiving_fences_then_frees_its_pages(make_pair):
    pr = make_pair(dense("prefill"), dense("decode"))
    ids = _prompts([100])[0]
    pr.submit("a1", ids)

    def receiving() -> bool:
        t = next(iter(pr.d.agent.transfers.values()), None)
        return t is not None and t.num_chunks > 0

    pr.pump(receiving)
    pr.d.abort("a1")
    pr.pump(lambda: pr.finished("prefill", "a1") and pr.finished("decode", "a1"))
    assert pr.last("decode", "a1").finish_reason == "abort"
    _failed(pr, "a1", "prefill", Cause.PEER_FAILED)
    _clean(pr)  # prefill's Released lifted the fence


def test_a_transfer_held_past_its_timeout_is_a_timeout_error(make_pair):
    pr = make_pair(
        dense(
            "prefill", test_delay_transfer_s=2.0, transfer_timeout_s=1.0, bootstrap_timeout_s=1.0
        ),
        dense("decode"),
    )
    began = time.time()
    pr.submit("t1", _prompts([40])[0])
    pr.pump(lambda: pr.finished("decode", "t1") and pr.finished("prefill", "t1"))
    assert time.time() - began < 10
    _failed(pr, "t1", "prefill", Cause.TIMEOUT)
    _failed(pr, "t1", "decode", Cause.TIMEOUT)  # prefill told decode
    time.sleep(2.5)  # the late headers arrive and are dropped
    _clean(pr)


def test_a_lost_decode_fails_prefill_and_lets_its_agent_go(make_pair):
    pr = make_pair(dense("prefill"), dense("decode"))
    pr.submit("w", _prompts([17])[0])
    pr.pump(lambda: pr.finished("decode", "w") and pr.finished("prefill", "w"))
    link = pr.p.agent.peers[pr.d.agent.addr].link
    assert link.agent.remote == {link.peer: 1}
    pr.submit("l1", _prompts([100])[0], send_decode=False)  # waits as an orphan on decode
    pr.pump(lambda: bool(pr.d.agent.orphans))
    pr.d.agent.close()  # decode's transfer agent goes away
    pr.pump(lambda: pr.finished("prefill", "l1"), timeout=5)
    _failed(pr, "l1", "prefill", Cause.PEER_LOST)
    assert link.closed and link.agent.remote == {}  # decode's NIXL agent is let go
    with pytest.raises(ConnectionError):
        link.move(None, None)  # a late write through the old link is refused, never attempted
    pr.p.flush_prefix_cache()
    assert pr.p.scheduler.page_pool.num_used == 0


def test_a_lost_prefill_mid_transfer_fails_decode_and_forgets_its_agent(make_pair):
    pr = make_pair(dense("prefill"), dense("decode"))
    pr.submit("p1", _prompts([100])[0])

    def receiving() -> bool:
        t = next(iter(pr.d.agent.transfers.values()), None)
        return t is not None and t.num_chunks > 0

    pr.pump(receiving)
    backend = pr.d.agent.backend
    assert len(backend.peers) == 1 and backend.agent.senders
    pr.p.agent.close()  # prefill goes away with pieces still to send
    deadline = time.time() + 10
    while not pr.finished("decode", "p1"):
        assert time.time() < deadline, pr.outs
        pr.d.poll_transfers()
        if pr.d.has_work:
            for o in pr.d.step().outputs:
                pr.outs.setdefault(("decode", o.rid), []).append(o)
        time.sleep(0.005)
    _failed(pr, "p1", "decode", Cause.PEER_LOST)
    assert backend.peers == {} and backend.agent.senders == {}  # its agent's notifications: no more
    pr.d.flush_prefix_cache()
    assert pr.d.scheduler.page_pool.num_used == 0


@pytest.mark.parametrize("sides", [("nixl", "tcp"), ("tcp", "nixl")])
def test_a_nixl_side_with_a_tcp_peer_frames_its_pieces(make_pair, sides):
    single = dense("single")
    prompts = _prompts([17, 70])
    want = generate(single, prompts, PARAMS)
    p_side, d_side = sides
    pr = make_pair(
        dense_engine("prefill", transfer_backend=p_side),
        dense_engine("decode", transfer_backend=d_side),
    )
    _same(pr, _run(pr, prompts), want)
    assert isinstance(pr.p.agent.peers[pr.d.agent.addr].link, FramedLink)
    moved = sum(map(len, prompts)) * sum(k.row_bytes for k in pr.d.agent.kinds)
    assert pr.p.agent.take_stats()[0]["sent"]["tcp"] == moved
    assert pr.d.agent.take_stats()[0]["installed"]["tcp"] == moved
    _clean(pr)


# -- DeepSeek-V4: every cache kind through NIXL --------------------------------------------------


def test_dsv4_pd_over_nixl_equals_single_engine_at_concurrency_1_and_16(make_pair):
    single = dsv4_engine("single")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    alone = _prompts([150])
    many = _prompts([5, 16, 17, 30, 45, 64, 70, 100, 110, 130, 22, 33, 12, 90, 8, 60])
    want_alone, want_many = generate(single, alone, params), generate(single, many, params)
    pr = make_pair(dsv4("prefill"), dsv4("decode"))
    written = set()  # the cache kinds of pieces that came written in place (through NIXL)
    install = pr.d.agent._install

    def spy(t, h, ev):
        if h.in_place:
            written.update(h.kinds)
        return install(t, h, ev)

    pr.d.agent._install = spy
    _same(pr, _run(pr, alone, params, prefix="a", timeout=120), want_alone)
    kinds = pr.d.agent.kinds
    assert written == {k.name for k in kinds}  # every kind, paged and per-request state
    assert {k.unit for k in kinds} == {"page", "slot"}
    _same(pr, _run(pr, many, params, prefix="m", timeout=240), want_many)
    _clean(pr)
    sent, installed = pr.p.agent.take_stats()[0], pr.d.agent.take_stats()[0]
    assert set(sent["sent"]) == {"nixl"} and set(installed["installed"]) == {"nixl"}
    assert sent["sent"]["nixl"] == installed["installed"]["nixl"] > 0


def test_dsv4_a_damaged_piece_frees_pages_and_slots(make_pair):
    pr = make_pair(dsv4("prefill", test_corrupt_p=1.0), dsv4("decode"))
    pr.submit("c1", _prompts([110])[0])
    pr.pump(lambda: pr.finished("decode", "c1") and pr.finished("prefill", "c1"), timeout=60)
    _failed(pr, "c1", "decode", Cause.CHECKSUM)
    _failed(pr, "c1", "prefill", Cause.CHECKSUM)
    _clean(pr)


# -- strangers -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decode():
    e = dense("decode")
    yield e
    e.agent.close()


def _stranger_agent() -> N.Agent:
    return N.Agent()


def test_a_stranger_without_the_secret_cannot_get_decode_to_take_its_nixl_agent(decode):
    stranger = _stranger_agent()  # a real NIXL agent, whose metadata it offers
    backend = decode.agent.backend
    peer = FakePeer.connect(decode.agent.addr)
    mine = hello(decode, "prefill")
    peer.send(mine)
    challenge = peer.recv()
    assert isinstance(challenge, P.Hello)
    offer = P.NixlAgent(stranger.name, stranger.nx.get_agent_metadata())
    peer.send(P.Auth(secrets.token_bytes(32), nixl=offer))
    refusal = peer.recv()
    assert isinstance(refusal, P.Failure) and refusal.cause == Cause.UNAUTHENTICATED
    assert peer.hung_up()  # and nothing else came: no Auth, so none of decode's metadata
    assert backend.peers == {} and stranger.name not in backend.agent.senders
    # Even with decode's metadata (taken here in-process), its notifications are dropped.
    name = stranger.load(backend._offer.metadata)
    before = backend.agent.dropped
    stranger.nx.send_notif(name, b"t-x|L0.k|0|16")
    deadline = time.time() + 5
    while backend.agent.dropped == before:
        assert time.time() < deadline, "the stranger's notification never arrived"
        stranger.nx.get_new_notifs()  # progresses the stranger's agent (its send)
        time.sleep(0.01)
    assert not backend.agent.notifs
    stranger.unload(name)
    stranger.close()


def _authenticate(decode, claimed: P.NixlAgent, sent: P.NixlAgent):
    """A prefill holding the secret whose proof covers `claimed` but whose Auth carries
    `sent`; decode's answer."""
    peer = FakePeer.connect(decode.agent.addr)
    mine = hello(decode, "prefill")
    peer.send(mine)
    theirs = peer.recv()
    args = (mine.nonce, theirs.nonce, mine.instance_id, theirs.instance_id)
    peer.send(P.Auth(H.proof(PD_SECRET, "prefill", *args, H.binding(claimed)), nixl=sent))
    return peer, args, peer.recv()


def test_the_proof_covers_the_nixl_agent_both_ways(decode):
    # An Auth whose NIXL agent was changed after its proof was made is refused.
    peer, _, answer = _authenticate(decode, P.NixlAgent("honest"), P.NixlAgent("swapped"))
    assert isinstance(answer, P.Failure) and answer.cause == Cause.UNAUTHENTICATED
    assert peer.hung_up()
    # The honest one gets decode's agent: its metadata and every kind's rows, under decode's proof.
    peer, args, answer = _authenticate(decode, P.NixlAgent("honest"), P.NixlAgent("honest"))
    assert isinstance(answer, P.Auth) and answer.nixl is not None and answer.nixl.metadata
    assert {r.name for r in answer.nixl.regions} == {k.name for k in decode.agent.kinds}
    assert H.proof_ok(H.proof(PD_SECRET, "decode", *args, H.binding(answer.nixl)), answer.proof)
    assert not H.proof_ok(H.proof(PD_SECRET, "decode", *args), answer.proof)
    peer.close()


@pytest.fixture(scope="module")
def prefill():
    e = dense("prefill", connect_timeout_s=1.0)
    yield e
    e.agent.close()


def _fake_decode(prefill, answer):
    """A listener playing decode: hello, prefill's Auth (what it says of its agent: its name
    only), then `answer(args)` as decode's Auth (args: both nonces and instance ids)."""
    said = []

    def script(peer: FakePeer, prefill_hello) -> None:
        mine = hello(prefill, "decode")
        peer.send(mine)
        auth = peer.recv()
        said.append(auth)
        peer.send(
            answer((prefill_hello.nonce, mine.nonce, prefill_hello.instance_id, mine.instance_id))
        )

    return FakeDecode(script), said


def test_an_impostor_decode_cannot_get_prefill_to_load_its_nixl_agent(prefill):
    stranger = _stranger_agent()
    offer = P.NixlAgent(
        stranger.name, stranger.nx.get_agent_metadata(), N.regions(prefill.agent.kinds)
    )
    fake, said = _fake_decode(prefill, lambda args: P.Auth(secrets.token_bytes(32), nixl=offer))
    o = _prefill_alone(prefill, "i1", fake.addr)
    fake.join()
    assert o.cause == Cause.UNAUTHENTICATED and "failed to prove" in o.error, o.error
    assert prefill.agent.backend.agent.remote == {}  # its metadata was never loaded
    nixl = said[0].nixl  # prefill named its agent, and showed nothing more of it
    assert nixl.name == prefill.agent.backend.agent.name and not nixl.metadata and not nixl.regions
    stranger.close()


def test_nixl_metadata_that_cannot_load_is_an_ipc_failure(prefill):
    offer = P.NixlAgent("kvrelay-bogus", b"not nixl metadata", N.regions(prefill.agent.kinds))
    fake, _ = _fake_decode(
        prefill,
        lambda args: P.Auth(H.proof(PD_SECRET, "decode", *args, H.binding(offer)), nixl=offer),
    )
    o = _prefill_alone(prefill, "i2", fake.addr)
    fake.join()
    assert o.cause == Cause.IPC and "cannot load decode's NIXL agent" in o.error, o.error
    assert prefill.agent.backend.agent.remote == {}


# -- real servers: SmolLM2 through the router ------------------------------------------------------

MODEL = "smollm2"
STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
    "listening to the sea, and writing the weather into a leather notebook. "
)


@pytest.fixture(scope="module")
def pd():
    # No prefix cache (the kill tests catch requests mid-transfer) and a fixed transfer port
    # (the restarted decode is where it was: prefill sees a new instance there).
    nixl = ("--transfer-backend", "nixl", "--disable-prefix-cache")
    stack = PDStack(
        prefill_args=nixl,
        decode_args=(*nixl, "--transfer-port", str(free_port())),
        max_total_tokens=8192,
    )
    yield stack
    stack.close()


def _specs(n: int) -> list[dict]:
    prompts = [
        "The capital of France is",
        "1, 2, 3, 4,",
        "Write a list of fruits:",
        STORY * 3,
        STORY * 6,
    ]
    specs = []
    for i in range(n):
        chat = i % 4 == 3
        specs.append(
            {
                "kind": "chat" if chat else "completion",
                ("content" if chat else "prompt"): prompts[i % len(prompts)] + f" ({i})",
                "stream": i % 2 == 1,
                "max_tokens": 8 + i % 5,
                "logprobs": (i % 2 == 1) if chat else (2 if i % 3 == 0 else None),
            }
        )
    return specs


def _bytes(url: str, direction: str) -> float:
    return metrics(url).get(
        f'kvrelay_pd_transfer_bytes_total{{backend="nixl",direction="{direction}"}}', 0
    )


def test_smollm2_pd_over_nixl_equals_single_server_at_concurrency_1_and_16(pd, server):
    specs = _specs(16)
    want = run_specs(server.url, MODEL, specs)  # all 16 at once
    got = run_specs(pd.router.url, MODEL, specs)
    assert_same_outputs(specs, want, got, abs=1e-3)
    c = client(pd.router.url)
    alone = [run_spec(c, MODEL, s) for s in specs[:4]]  # one at a time
    assert_same_outputs(specs[:4], want[:4], alone, abs=1e-3)
    pd.wait_idle()
    sent, installed = _bytes(pd.prefill.url, "sent"), _bytes(pd.decode.url, "installed")
    assert sent == installed > 0
    send_s = metrics(pd.prefill.url)['kvrelay_pd_transfer_seconds_sum{phase="send",side="prefill"}']
    print(f"nixl: {sent / 1e6:.1f} MB sent in {send_s:.3f} s of sending (gather, checksum, write)")
    for side in ("prefill", "decode"):
        events = bootstrap_events(getattr(pd, side).url)
        assert events.get("peer_connected", 0) >= 1 and not events.get("ipc_open_failed"), events


def test_a_stranger_at_a_real_decode_gets_no_nixl_metadata(pd):
    info = httpx.get(pd.decode.url + "/pd/info").json()
    peer = FakePeer.connect(info["transfer_addr"])
    peer.send(P.Hello("intruder", "prefill", info["layout"], H.new_nonce()))
    assert isinstance(peer.recv(), P.Hello)
    peer.send(P.Auth(secrets.token_bytes(32), nixl=P.NixlAgent("intruder", b"\0" * 64)))
    refusal = peer.recv()
    assert isinstance(refusal, P.Failure) and refusal.cause == Cause.UNAUTHENTICATED
    assert peer.hung_up()
    assert "cause=peer_unauthenticated" in pd.decode.log()


def _counted(url: str, before: dict, timeout: float = 15.0) -> dict[str, float]:
    """The transfer failures a server counted since `before`, once there are some (the engine
    ships its counters to the API a moment later)."""
    deadline = time.time() + timeout
    while True:
        lost = _new_failures(url, before, "kvrelay_pd_transfer_failures_total")
        if lost:
            return lost
        assert time.time() < deadline, f"{url} counted no transfer failure"
        time.sleep(0.2)


def test_decode_killed_mid_transfer_then_restarted_alone(pd):
    """NIXL writes into a decode that dies: prefill's failed writes and the lost connection end
    every transfer within the bound, prefill lets the dead agent go, and the restarted decode's
    new agent (new metadata, same address) serves the next requests through NIXL."""
    prefill_before = metrics(pd.prefill.url)
    outs, t_kill = _in_flight_then(
        pd,
        400,
        ready=lambda s, streaming: (
            streaming and _transfers(s.decode.url, "reserved", "receiving") > 0
        ),
        action=lambda: pd.kill("decode"),
    )
    # A request whose NIXL write is the first to find decode gone fails on prefill first
    # (peer_connection_lost: UCX notices the death before the TCP connection's close arrives).
    causes = {"decode_unreachable", "stream_broken", "peer_connection_lost"}
    failed = _check_failures(outs, t_kill, causes)
    print(
        f"decode killed: {len(failed)} failed, last {max(o['end'] for o in failed) - t_kill:.1f}s after"
    )
    assert httpx.get(pd.prefill.url + "/health", timeout=5).status_code == 200
    lost = _counted(pd.prefill.url, prefill_before)
    assert set(lost) <= {"peer_connection_lost", "aborted"}, lost
    sent = _bytes(pd.prefill.url, "sent")
    _restart_alone(pd, "decode")  # 32 requests succeed, then idle on both sides
    events = _new_failures(pd.prefill.url, prefill_before, BOOTSTRAP)
    assert events.get("peer_restarted") == 1 and not events.get("ipc_open_failed"), events
    assert _bytes(pd.prefill.url, "sent") > sent and _bytes(pd.decode.url, "installed") > 0


def test_prefill_killed_mid_transfer_then_restarted_alone(pd):
    decode_before = metrics(pd.decode.url)
    outs, t_kill = _in_flight_then(
        pd,
        24,
        ready=lambda s, streaming: (
            _transfers(s.prefill.url, "prefilling") > 0
            and _transfers(s.decode.url, "receiving") > 0
        ),
        action=lambda: pd.kill("prefill"),
    )
    _check_failures(outs, t_kill, {"prefill_unreachable", "peer_connection_lost"}, late_ok=True)
    assert httpx.get(pd.decode.url + "/health", timeout=5).status_code == 200
    deadline = time.time() + 15
    while _transfers(pd.decode.url, "reserved", "receiving", "orphaned", "fenced"):
        assert time.time() < deadline, "decode still holds transfers of the dead prefill"
        time.sleep(0.2)
    lost = _counted(pd.decode.url, decode_before)
    assert set(lost) <= {"peer_connection_lost", "aborted"}, lost
    installed = _bytes(pd.decode.url, "installed")
    _restart_alone(pd, "prefill")
    assert _bytes(pd.decode.url, "installed") > installed  # the new prefill's agent writes too


# -- real servers: DeepSeek-V4 (dsv4-tiny, dummy weights) through the router ----------------------

DSV4 = ("--model", "dsv4-tiny", "--load-format", "dummy")


@pytest.fixture(scope="module")
def dsv4_servers():
    """A single dsv4-tiny server and a nixl PD stack of the same model (prefill chunks of 22
    tokens: chunks end mid compressor window), started side by side."""
    nixl = ("--transfer-backend", "nixl")
    with engine_threads(), ThreadPoolExecutor(2) as ex:
        fs = ex.submit(
            ServerProcess, *DSV4, "--max-total-tokens", "4096", "--max-num-batched-tokens", "64"
        )
        fp = ex.submit(
            PDStack,
            prefill_args=(*nixl, "--max-num-batched-tokens", "22"),
            decode_args=nixl,
            max_total_tokens=4096,
            model=DSV4,
        )
    try:
        yield fs.result(), fp.result()
    finally:
        for f in (fs, fp):
            if f.exception() is None:
                f.result().close()


def test_dsv4_pd_over_nixl_equals_single_server_at_concurrency_1_and_16(dsv4_servers):
    single, pd = dsv4_servers
    # test_pd_dsv4.py's requests (prompts up to 175 tokens: compressed entries of both ratios,
    # a full window, open compressor windows), each twice: 16 at once
    specs = dsv4_specs() * 2
    want = run_specs(single.url, "dsv4-tiny", specs)
    got = run_specs(pd.router.url, "dsv4-tiny", specs)
    # within 1e-4 relative: served dsv4-tiny simulates QAT (test_pd_dsv4.py says why)
    assert_same_outputs(specs, want, got, rel=1e-4, abs=1e-4)
    c = client(pd.router.url)
    alone = [run_spec(c, "dsv4-tiny", s) for s in specs[:3]]
    assert_same_outputs(specs[:3], want[:3], alone, rel=1e-4, abs=1e-4)
    pd.wait_idle()
    sent, installed = _bytes(pd.prefill.url, "sent"), _bytes(pd.decode.url, "installed")
    assert sent == installed > 0
    assert (
        metrics(pd.prefill.url).get(
            'kvrelay_pd_transfer_bytes_total{backend="tcp",direction="sent"}', 0
        )
        == 0
    )  # every kind went through NIXL, none framed
