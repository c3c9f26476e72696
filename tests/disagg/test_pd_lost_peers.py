"""A side of a PD pair goes away mid-request, through real processes (one stack, used in turn):
the client that disconnects mid-stream, then a SIGKILLed decode server, then a SIGKILLed prefill
server, each restarted alone on its old port.

Every in-flight request ends within a bounded time with an error naming its cause (an HTTP error,
or an SSE error event once streaming has begun), the failure is counted in /metrics, the surviving
server stays healthy with nothing leaked (KV pages, requests, per-state transfer gauges), and
after the restart the next 32 requests all succeed.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import free_port
from conversations import token_bytes, two_turns
from openai_calls import client
from pd_stack import PDStack, metrics, pd_gauges

MODEL = "smollm2"
STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
    "listening to the sea, and writing the weather into a leather notebook. "
)
BOOTSTRAP = "kvrelay_pd_bootstrap_events_total"
ERROR_BOUND_S = 15.0  # kill -> every in-flight request has its error (CPU shared with other tests)


@pytest.fixture(scope="module")
def stack():
    # A fixed KV listener port: the restarted decode is at the same address, so prefill can tell
    # it restarted (a new instance id there).
    # No prefix cache on either side: these tests catch requests mid-transfer, and prompts that
    # earlier tests here already sent would otherwise prefill (and transfer) too fast to catch.
    s = PDStack(
        max_total_tokens=8192,
        decode_args=("--transfer-port", str(free_port()), "--disable-prefix-cache"),
        prefill_args=("--disable-prefix-cache",),
    )
    yield s
    s.close()


def _request(url: str, i: int, prompt: str, max_tokens: int, streaming: set | None = None) -> dict:
    """One completion (odd i: streamed); never raises: the outcome and when it ended."""
    c = client(url, timeout=120)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    kw["extra_body"] = {"ignore_eos": True}
    chunks = 0
    try:
        if i % 2:
            for _ in c.completions.create(stream=True, **kw):
                chunks += 1
                if streaming is not None:
                    streaming.add(i)  # the client has seen tokens
            return {"ok": True, "end": time.time(), "chunks": chunks}
        c.completions.create(**kw)
        return {"ok": True, "end": time.time()}
    except openai.APIError as e:
        return {
            "ok": False,
            "end": time.time(),
            "status": getattr(e, "status_code", None),  # None: an SSE error event mid-stream
            "code": e.code,
            "error": str(e),
            "chunks": chunks,
        }


def _in_flight_then(stack: PDStack, max_tokens: int, ready, action) -> tuple[list[dict], float]:
    """Start 6 long requests (half streamed), wait until `ready(stack, streaming)` (`streaming`:
    the requests whose client has seen tokens), run `action`; return the requests' outcomes and
    the time `action` returned."""
    prompts = [STORY * (2 + i % 3) for i in range(6)]  # 2-4 prefill chunks of 64 tokens
    streaming: set[int] = set()
    with ThreadPoolExecutor(len(prompts)) as ex:
        futs = [
            ex.submit(_request, stack.router.url, i, p, max_tokens, streaming)
            for i, p in enumerate(prompts)
        ]
        deadline = time.time() + 60
        while not ready(stack, streaming):
            assert time.time() < deadline, "requests never got in flight"
            time.sleep(0.05)
        t = action()
        return [f.result() for f in futs], t


def _transfers(url: str, *states: str) -> float:
    g = pd_gauges(url)
    return sum(v for k, v in g.items() if any(f'state="{s}"' in k for s in states))


def _new_failures(url: str, before: dict[str, float], name: str) -> dict[str, float]:
    """Failures by cause counted by a server since `before` (a `metrics` snapshot)."""
    return {
        k.split('"')[1]: v - before.get(k, 0.0)
        for k, v in metrics(url).items()
        if k.startswith(name + "{") and v > before.get(k, 0.0)
    }


def _recovers(stack: PDStack, n: int = 32) -> None:
    """The next n requests (mixed streaming, varied prompts) all succeed."""
    prompts = [f"Count from {i}: {i}, {i + 1}," for i in range(n)]
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda a: _request(stack.router.url, a[0], a[1], 4), enumerate(prompts)))
    failed = [o for o in outs if not o["ok"]]
    assert not failed, f"{len(failed)} of {n} failed after recovery: {failed[:3]}"


def _restart_alone(stack: PDStack, side: str) -> None:
    """Restart one side only; the stack serves again and settles idle."""
    t = time.time()
    stack.restart(side)
    print(f"{side} restarted in {time.time() - t:.1f}s")
    _recovers(stack)
    stack.wait_idle()


def _check_failures(
    outs: list[dict], t_kill: float, causes: set[str], late_ok: bool = False
) -> list[dict]:
    """Every failure is a 5xx or an SSE error event naming a cause, within the bound. A success
    must have ended before the kill, unless `late_ok` (its KV was on decode already)."""
    failed = [o for o in outs if not o["ok"]]
    assert failed, "no request was in flight when the server died"
    for o in outs:
        if o["ok"]:
            assert late_ok or o["end"] < t_kill, o
            continue
        assert o["end"] - t_kill < ERROR_BOUND_S, f"error {o['end'] - t_kill:.1f}s after the kill"
        assert o["status"] is None or o["status"] >= 500, o
        assert o["code"] in causes, f"error names no known cause: {o}"
    return failed


def test_without_decode_prefix_cache_every_turn_moves_its_whole_prompt(stack, server):
    """Decode's reuse turned off (`--disable-prefix-cache` on decode): a second turn still
    equals the single server token for token, and its whole prompt's KV moves."""
    _, got, moved = two_turns(stack, server.url, 1)
    assert moved == {"bytes": got[0]["prompt_n"] * token_bytes(), "hits": 0}
    assert got[0]["cached"] == 0  # neither side has a prefix cache here


def test_client_disconnect_mid_stream_frees_everything(stack):
    before = stack.router.metric("kvrelay_router_client_disconnects_total")
    body = {
        "model": MODEL,
        "prompt": STORY * 3,
        "max_tokens": 2000,  # minutes of decode on CPU: only an abort frees it in time
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", stack.router.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        assert metrics(stack.decode.url)["kvrelay_num_requests_running"] == 1
    t = time.time()
    idle_s = stack.wait_idle(timeout=10)
    print(f"client disconnect mid-stream: idle {idle_s:.1f}s later")
    assert time.time() - t < 10
    assert stack.router.metric("kvrelay_router_client_disconnects_total") == before + 1


def test_client_disconnect_before_the_first_token_frees_everything(stack):
    """Gone while decode still waits for the KV: the router closes decode's stream when it
    starts (its generator never runs), so decode aborts instead of generating 2000 tokens."""
    before = stack.router.metric("kvrelay_router_client_disconnects_total")
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": STORY * 4,
            "max_tokens": 2000,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", stack.router.port)) as sock:
        sock.sendall(head + body)
        deadline = time.time() + 30
        while not _transfers(stack.decode.url, "reserved", "receiving"):
            assert time.time() < deadline, "the request never reached decode"
            time.sleep(0.02)
    idle_s = stack.wait_idle(timeout=15)
    print(f"client disconnect before the first token: idle {idle_s:.1f}s later")
    assert stack.router.metric("kvrelay_router_client_disconnects_total") == before + 1


def test_decode_killed_mid_transfer_then_restarted_alone(stack):
    router_before, prefill_before = metrics(stack.router.url), metrics(stack.prefill.url)
    outs, t_kill = _in_flight_then(
        stack,
        400,  # no request can finish before the kill
        # one client mid-stream (its error must come as an SSE event), others mid-transfer
        ready=lambda s, streaming: (
            streaming and _transfers(s.decode.url, "reserved", "receiving") > 0
        ),
        action=lambda: stack.kill("decode"),
    )
    failed = _check_failures(outs, t_kill, {"decode_unreachable", "stream_broken"})
    streamed = [o for o in failed if o.get("chunks")]
    assert streamed and all((o["status"], o["code"]) == (None, "stream_broken") for o in streamed)
    print(
        f"decode killed: {len(failed)} failed ({len(streamed)} mid-stream), last error "
        f"{max(o['end'] for o in failed) - t_kill:.1f}s after the kill: "
        f"{sorted({(o['status'], o['code']) for o in failed}, key=str)}"
    )
    # Prefill stays healthy, and drops what it held for the dead decode.
    assert httpx.get(stack.prefill.url + "/health", timeout=5).status_code == 200
    deadline = time.time() + ERROR_BOUND_S
    while any(
        metrics(stack.prefill.url)[k]
        for k in ("kvrelay_kv_pages_used", "kvrelay_num_requests_running")
    ) or _transfers(stack.prefill.url, "bootstrapping", "prefilling", "sending"):
        assert time.time() < deadline, f"prefill still holds state: {pd_gauges(stack.prefill.url)}"
        time.sleep(0.2)
    routed = _new_failures(stack.router.url, router_before, "kvrelay_router_failures_total")
    assert sum(routed.values()) >= len(failed), routed
    lost = _new_failures(stack.prefill.url, prefill_before, "kvrelay_pd_transfer_failures_total")
    print(f"failures counted: router {routed}, prefill {lost}")
    assert lost and set(lost) <= {"peer_connection_lost", "aborted"}, lost

    _restart_alone(stack, "decode")
    events = _new_failures(stack.prefill.url, prefill_before, BOOTSTRAP)
    print(f"prefill's bootstrap events: {events}")
    assert events.get("peer_lost", 0) >= 1 and events.get("peer_restarted") == 1, events
    assert events.get("peer_connected", 0) >= 1, events


def test_prefill_killed_mid_transfer_then_restarted_alone(stack):
    router_before, decode_before = metrics(stack.router.url), metrics(stack.decode.url)
    outs, t_kill = _in_flight_then(
        stack,
        24,
        ready=lambda s, streaming: (
            _transfers(s.prefill.url, "prefilling") > 0
            and _transfers(s.decode.url, "receiving") > 0
        ),
        action=lambda: stack.kill("prefill"),
    )
    failed = _check_failures(
        outs,
        t_kill,
        {"prefill_unreachable", "peer_connection_lost"},
        late_ok=True,
    )
    print(
        f"prefill killed: {len(failed)} failed, last error "
        f"{max(o['end'] for o in failed) - t_kill:.1f}s after the kill: "
        f"{sorted({(o['status'], o['code']) for o in failed}, key=str)}"
    )
    # Decode stays healthy; its reservations for the dead prefill are released (no timeout wait).
    assert httpx.get(stack.decode.url + "/health", timeout=5).status_code == 200
    deadline = time.time() + ERROR_BOUND_S
    while True:
        m = metrics(stack.decode.url)
        busy = _transfers(stack.decode.url, "reserved", "receiving", "orphaned")
        # Requests that got their KV before the kill may still be decoding: they end by themselves.
        if not busy and not m["kvrelay_num_requests_waiting"]:
            break
        assert time.time() < deadline, f"decode still holds state: {pd_gauges(stack.decode.url)}"
        time.sleep(0.2)
    routed = _new_failures(stack.router.url, router_before, "kvrelay_router_failures_total")
    assert routed.get("prefill_unreachable", 0) >= 1, routed
    lost = _new_failures(stack.decode.url, decode_before, "kvrelay_pd_transfer_failures_total")
    print(f"failures counted: router {routed}, decode {lost}")
    assert lost and set(lost) <= {"peer_connection_lost", "aborted"}, lost

    _restart_alone(stack, "prefill")
    # Decode can't tell a restarted prefill (it connects from a fresh port): lost, then connected.
    events = _new_failures(stack.decode.url, decode_before, BOOTSTRAP)
    print(f"decode's bootstrap events: {events}")
    assert events.get("peer_lost", 0) >= 1 and events.get("peer_connected", 0) >= 1, events
