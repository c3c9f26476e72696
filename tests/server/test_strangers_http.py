"""What a stranger can do to a server's HTTP listener, against a real `kvrelay serve` process:
slowloris connections are closed by the read deadlines while other clients are served; a body
with both Content-Length and Transfer-Encoding is refused at once; a replayed (or stale) signed
PD body is refused 403 and counted in /metrics.

The server runs with 1 s header and body deadlines (KVRELAY_HTTP_*_TIMEOUT_S) and at most 200
connections waiting for their headers, so that every verdict here comes within seconds whatever
the machine's load.
"""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import pytest
from conftest import ServerProcess

from kvrelay.disagg import handshake as H

SECRET = "strangers-http-secret"
DEADLINE_S = 1.0
MAX_PENDING = 200  # connections waiting for their headers at once


@pytest.fixture(scope="module")
def server():
    knobs = {
        "KVRELAY_HTTP_HEADER_TIMEOUT_S": "1",
        "KVRELAY_HTTP_BODY_TIMEOUT_S": "1",
        "KVRELAY_HTTP_MAX_PENDING": str(MAX_PENDING),
    }
    before = {k: os.environ.get(k) for k in knobs}
    os.environ.update(knobs)
    try:
        s = ServerProcess(
            *("--model", "qwen3-tiny", "--load-format", "dummy", "--max-total-tokens", "2048"),
            *("--role", "prefill", "--pd-secret", SECRET),
        )
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield s
    s.close()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    """Whether the server closes `s` within `within_s` (what it sends before is ignored)."""
    s.settimeout(0.2)
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            if s.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
    return False


def _at_eof(s: socket.socket) -> bool:
    """Whether the server has closed `s` already (without waiting)."""
    s.setblocking(False)  # (a socket with a timeout would wait for data first)
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _drips_until_closed(s: socket.socket, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            s.sendall(b"X")
        except (BrokenPipeError, ConnectionResetError):
            return True
        if _closed_by_server(s, 0.2):
            return True
    return False


def test_slowloris_connections_are_closed_while_other_clients_are_served(server):
    """150 connections: silent ones, ones whose headers never end, ones whose body never ends.
    Every one is closed within the deadline (plus slack); meanwhile a client is served."""
    silent = [_connect(server.url) for _ in range(50)]
    headers = [_connect(server.url) for _ in range(50)]
    for s in headers:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    bodies = [_connect(server.url) for _ in range(50)]
    for s in bodies:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": '
        )
    t0 = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=10) as http:
        body = {"model": "qwen3-tiny", "prompt": "Hello", "max_tokens": 2}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert http.get("/v1/models").status_code == 200
    # A drip of one header byte every 0.2 s is no activity that keeps a connection open.
    drip = _connect(server.url)
    drip.sendall(b"GET /v1/models HTTP/1.1\r\n")
    assert _drips_until_closed(drip, 3 * DEADLINE_S)
    for group in (silent, headers, bodies):
        assert all(_closed_by_server(s, 3 * DEADLINE_S) for s in group)
    assert time.monotonic() - t0 < 15
    for s in silent + headers + bodies + [drip]:
        s.close()


def test_past_the_cap_a_waiting_connection_is_closed_at_once(server):
    """250 silent connections against a cap of 200: the 50 past it are closed at once (long
    before the header deadline); once the deadline has freed the rest, a client is served."""
    t0 = time.monotonic()
    socks = [_connect(server.url) for _ in range(MAX_PENDING + 50)]
    at_once = 0
    while at_once < 50 and time.monotonic() - t0 < 0.8 * DEADLINE_S:  # before any deadline
        time.sleep(0.05)
        at_once = sum(_at_eof(s) for s in socks)
    assert at_once == 50, at_once
    assert all(_closed_by_server(s, 3 * DEADLINE_S) for s in socks)
    for s in socks:
        s.close()
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 200


def test_content_length_with_transfer_encoding_is_refused_at_once(server):
    s = _connect(server.url)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 40\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{"a":\r\n'
    )
    s.settimeout(0.8)  # before the body deadline: the answer is not a timeout's
    reply = b""
    try:
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    except TimeoutError:
        pass
    assert reply.startswith(b"HTTP/1.1 400"), reply
    assert b"ambiguous_body_length" in reply
    assert _closed_by_server(s, 2)
    s.close()


def _pd_body(rid: str) -> bytes:
    with socket.create_server(("127.0.0.1", 0)) as gone:  # a port nothing listens on after
        addr = f"127.0.0.1:{gone.getsockname()[1]}"
    pd = {"role": "prefill", "transfer_id": f"t-{rid}", "request_id": rid, "decode_addr": addr}
    body = {"model": "qwen3-tiny", "prompt": "hi", "max_tokens": 2, "kvrelay_pd": pd}
    return json.dumps(body).encode()


def _post(server, data: bytes, token: str) -> httpx.Response:
    headers = {"Content-Type": "application/json", H.PD_AUTH_HEADER: token}
    return httpx.post(server.url + "/v1/completions", content=data, headers=headers, timeout=30)


def _bootstrap_event(server, event: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f'kvrelay_pd_bootstrap_events_total{{event="{event}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_replayed_or_stale_signed_pd_body_is_refused_and_counted(server):
    data = _pd_body("replay-1")
    token = H.request_token(SECRET, data)
    first = _post(server, data, token)  # taken (it fails later: its decode is nowhere)
    assert first.status_code != 403, first.text
    again = _post(server, data, token)
    assert again.status_code == 403 and again.json()["error"]["code"] == "pd_auth_failed"
    stale_data = _pd_body("stale-1")
    stale = H.request_token(SECRET, stale_data, now=time.time() - 10 * H.REQUEST_WINDOW_S)
    r = _post(server, stale_data, stale)
    assert r.status_code == 403 and r.json()["error"]["code"] == "pd_auth_failed"
    fresh = _pd_body("fresh-1")  # the same server still takes a fresh signature
    assert _post(server, fresh, H.request_token(SECRET, fresh)).status_code != 403
    deadline = time.monotonic() + 10  # shown within a heartbeat of the engine loop (1 s)
    while _bootstrap_event(server, "pd_request_replayed") < 1:
        assert time.monotonic() < deadline, httpx.get(server.url + "/metrics").text
        time.sleep(0.2)
    assert _bootstrap_event(server, "pd_request_replayed") == 1
    assert _bootstrap_event(server, "pd_request_stale") == 1
