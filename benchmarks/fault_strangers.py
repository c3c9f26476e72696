"""The fault campaign's stranger phase (fault_campaign.py --phases stranger): what a process on the
same host can throw at a serving PD stack, while the usual load runs and is judged.

  transfer_flood   rounds of idle and garbage connections to decode's transfer listener, each
                   round held past the handshake deadline: every one must be refused (past the
                   cap), closed as garbage or dropped at the deadline, and counted by decode
  slowloris        connections to the router and both servers that never finish their headers:
                   each must be closed by the server within its header deadline
  ambiguous_length requests to the router with both Content-Length and Transfer-Encoding: 400
  replay           a signed PD body (signed with the stack's secret, as one captured from the
                   router would be) sent once, then again: every replay 403, counted by the server
  stale            a body signed well outside the time window: 403, counted
  hostile_schema   the audit's schemas that gave 5xx (an integer minimum of 10**400, a required
                   self-reference, format + pattern, a 50k-alternative grammar) through the
                   router: 400 each
Counts of each, what the servers counted, and a problem for any attack that was not refused.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections import Counter

import httpx

from kvrelay.disagg import handshake as H
from kvrelay.disagg.transport.tcp import HANDSHAKE_DEADLINE_S, parse_addr

HEADER_DEADLINE_S = 10.0  # the servers' KVRELAY_HTTP_HEADER_TIMEOUT_S default
STRANGER_EVENTS = ("stranger_refused", "stranger_garbage", "handshake_timeout")
BOOTSTRAP = re.compile(r'^kvrelay_pd_bootstrap_events_total\{event="([^"]+)"\} ([0-9.e+-]+)$', re.M)


def bootstrap_events(url: str) -> Counter:
    text = httpx.get(url + "/metrics", timeout=5).text
    return Counter({m[1]: int(float(m[2])) for m in BOOTSTRAP.finditer(text)})


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def transfer_flood(addr: str, rounds: int, idle: int, garbage: int) -> int:
    """Connections opened (each round held past the handshake deadline, then closed)."""
    opened = 0
    for _ in range(rounds):
        socks = []
        for i in range(idle + garbage):
            try:
                s = socket.create_connection(parse_addr(addr), timeout=5)
            except OSError:
                continue
            opened += 1
            if i < garbage:
                try:
                    s.sendall(b"GARBAGE!" + os.urandom(24))
                except OSError:
                    pass
            socks.append(s)
        time.sleep(HANDSHAKE_DEADLINE_S + 1)
        for s in socks:
            s.close()
    return opened


def slowloris(urls: list[str], per_target: int) -> tuple[int, int]:
    """(connections opened, still open past the header deadline + 3 s)."""
    socks = []
    for url in urls:
        for _ in range(per_target):
            s = socket.create_connection(_hostport(url), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            s.setblocking(False)
            socks.append(s)
    end = time.monotonic() + HEADER_DEADLINE_S + 3
    open_ = set(range(len(socks)))
    while open_ and time.monotonic() < end:
        for i in list(open_):
            try:
                if socks[i].recv(4096) == b"":
                    open_.discard(i)
            except BlockingIOError:
                pass
            except OSError:
                open_.discard(i)
        time.sleep(0.2)
    for s in socks:
        s.close()
    return len(socks), len(open_)


def ambiguous_length(url: str, n: int) -> Counter:
    """Status line of each answer to a request with both Content-Length and Transfer-Encoding."""
    seen: Counter = Counter()
    for _ in range(n):
        with socket.create_connection(_hostport(url), timeout=5) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 40\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{"a":\r\n'
            )
            s.settimeout(5)
            try:
                head = s.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
            except TimeoutError:
                head = "no answer within 5 s"
            seen[head] += 1
    return seen


def _pd_body(model: str, rid: str) -> bytes:
    with socket.create_server(("127.0.0.1", 0)) as gone:  # an address nothing listens on after
        addr = f"127.0.0.1:{gone.getsockname()[1]}"
    pd = {"role": "prefill", "transfer_id": f"t-{rid}", "request_id": rid, "decode_addr": addr}
    body = {"model": model, "prompt": "hi", "max_tokens": 2, "kvrelay_pd": pd}
    return json.dumps(body).encode()


def replays(prefill_url: str, model: str, secret: str, n: int) -> dict:
    """One signed body taken, then replayed n times; n bodies signed outside the window."""
    headers = {"Content-Type": "application/json"}
    status: dict[str, Counter] = {"first": Counter(), "replay": Counter(), "stale": Counter()}
    with httpx.Client(timeout=30) as http:
        data = _pd_body(model, f"captured-{time.monotonic_ns()}")
        token = H.request_token(secret, data)
        post = prefill_url + "/v1/completions"
        r = http.post(post, content=data, headers={**headers, H.PD_AUTH_HEADER: token})
        status["first"][str(r.status_code)] += 1
        for _ in range(n):
            r = http.post(post, content=data, headers={**headers, H.PD_AUTH_HEADER: token})
            status["replay"][str(r.status_code)] += 1
        old = time.time() - 10 * H.REQUEST_WINDOW_S
        for i in range(n):
            data = _pd_body(model, f"stale-{i}-{time.monotonic_ns()}")
            stale = H.request_token(secret, data, now=old)
            r = http.post(post, content=data, headers={**headers, H.PD_AUTH_HEADER: stale})
            status["stale"][str(r.status_code)] += 1
    return {k: dict(v) for k, v in status.items()}


def hostile_schemas(router_url: str, model: str) -> Counter:
    """The audit's schemas that gave 5xx through the router: status of each answer."""
    msg = [{"role": "user", "content": "hi"}]

    def chat(schema: dict) -> dict:
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        return {"model": model, "messages": msg, "max_tokens": 4, "response_format": rf}

    self_required = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    ebnf = "root ::= " + " | ".join(f'"w{i}"' for i in range(50_000))
    bodies = [
        ("/v1/chat/completions", chat({"type": "integer", "minimum": 10**400})),
        ("/v1/chat/completions", chat(self_required)),
        ("/v1/chat/completions", chat({"type": "string", "format": "date", "pattern": "^2"})),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "guided_grammar": ebnf}),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "guided_json": self_required}),
    ]  # fmt: skip
    seen: Counter = Counter()
    with httpx.Client(timeout=30) as http:
        for path, body in bodies:
            seen[str(http.post(router_url + path, json=body).status_code)] += 1
    return seen


def stranger_attacks(
    urls: dict[str, str], model: str, secret: str, a
) -> tuple[Counter, dict, list]:
    """Run every attack (the flood in a thread beside the others); (faults, details, problems)."""
    info = httpx.get(urls["decode"] + "/pd/info", timeout=5).json()
    before = {n: bootstrap_events(u) for n, u in urls.items() if n != "router"}
    flood: dict = {}
    flooder = threading.Thread(
        target=lambda: flood.update(
            opened=transfer_flood(
                info["transfer_addr"], a.flood_rounds, a.flood_idle, a.flood_garbage
            )
        )
    )
    flooder.start()
    loris_opened, loris_held = slowloris(list(urls.values()), a.slowloris_per_target)
    ambiguous = ambiguous_length(urls["router"], a.stranger_requests)
    replayed = replays(urls["prefill"], model, secret, a.stranger_requests)
    schemas = hostile_schemas(urls["router"], model)
    flooder.join()
    time.sleep(1.0)  # the last round's deadline passes; idle stats reach /metrics (0.25 s)
    after = {n: bootstrap_events(u) for n, u in urls.items() if n != "router"}
    counted = {n: dict(after[n] - before[n]) for n in after}
    refused_flood = sum(counted["decode"].get(e, 0) for e in STRANGER_EVENTS)
    n = a.stranger_requests
    faults = Counter(
        transfer_flood=flood.get("opened", 0),
        slowloris=loris_opened,
        ambiguous_length=n,
        replay=n,
        stale=n,
        hostile_schema=sum(schemas.values()),
    )
    details = {
        "flood_counted_by_decode": refused_flood,
        "slowloris_held_past_deadline": loris_held,
        "ambiguous_answers": dict(ambiguous),
        "replay_status": replayed,
        "hostile_schema_status": dict(schemas),
        "server_events": counted,
    }
    problems = []
    if refused_flood != faults["transfer_flood"]:
        problems.append(
            f"decode counted {refused_flood} of {faults['transfer_flood']} flood connections"
        )
    if loris_held:
        problems.append(f"{loris_held} slowloris connections still open past the header deadline")
    if sum(v for k, v in ambiguous.items() if " 400" in k) != n:
        problems.append(f"ambiguous bodies answered {dict(ambiguous)}, not 400 each")
    if replayed["replay"] != {"403": n} or replayed["stale"] != {"403": n}:
        problems.append(f"replays/stale answered {replayed}, not 403 each")
    if set(schemas) != {"400"}:
        problems.append(f"hostile schemas through the router answered {dict(schemas)}, not 400")
    if "403" in replayed["first"]:
        problems.append("the first use of a fresh signed body was refused")
    pe = counted.get("prefill", {})
    if pe.get("pd_request_replayed", 0) != n or pe.get("pd_request_stale", 0) != n:
        problems.append(f"prefill counted {pe}, not {n} replayed and {n} stale")
    return faults, details, problems
