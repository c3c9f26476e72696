"""The router's retry rule against scripted servers (no processes): a failed attempt is retried on
a fresh pair only while nothing was streamed to the client; once it has been, a broken decode
stream ends in an SSE error event instead."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import httpx
from fastapi.responses import StreamingResponse

from kvrelay.config import RouterConfig
from kvrelay.disagg.handshake import PD_AUTH_HEADER, request_token_ok
from kvrelay.router.routing import Router

BODY = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}
SECRET = "router-test-secret"


def _event(text: str) -> bytes:
    return f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode()


def _error(code: str) -> bytes:
    return f"data: {json.dumps({'error': {'message': code, 'code': code}})}\n\n".encode()


class Servers:
    """Scripted prefill and decode servers behind one mock transport. `prefill_fails` names the
    prefill hosts that fail their transfer (their decode answers with that cause as its first
    event, as a real decode does); `decode_breaks` makes decode's stream break after one event."""

    def __init__(self, prefill_fails=(), decode_breaks=False, first_error: str | None = None):
        self.prefill_fails, self.decode_breaks, self.first_error = (
            set(prefill_fails),
            decode_breaks,
            first_error,
        )
        self.calls: dict[str, int] = defaultdict(int)
        self.prefill_done: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.failed: set[str] = set()
        self.info_version = 0
        self.auth: set[str | None] = set()  # the Authorization headers the router sent

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.calls[(host, request.url.path)] += 1
        self.auth.add(request.headers.get("authorization"))
        if request.url.path == "/pd/info":
            role = "prefill" if host.startswith("p") else "decode"
            addr = f"{host}:{9000 + self.info_version}"
            return httpx.Response(
                200, json={"role": role, "instance_id": addr, "transfer_addr": addr}
            )
        # A real server takes the PD fields only with the router's token over the exact body.
        assert request_token_ok(SECRET, request.content, request.headers.get(PD_AUTH_HEADER))
        pd = json.loads(request.content)["kvrelay_pd"]
        tid = pd["transfer_id"]
        if pd["role"] == "prefill":
            if host in self.prefill_fails:
                self.failed.add(tid)
            self.prefill_done[tid].set()
            return httpx.Response(200, json={"choices": []})
        await self.prefill_done[tid].wait()  # decode's answer depends on how the transfer went

        async def stream():
            if tid in self.failed:
                yield _error("peer_connection_lost")
                return
            if self.first_error:
                yield _error(self.first_error)
                return
            yield _event("a")
            if self.decode_breaks:
                raise httpx.ReadError("decode died")
            yield _event("b")
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})


def _router(servers: Servers, max_attempts: int = 2, api_key: str = "") -> Router:
    cfg = RouterConfig(
        prefill=("http://p1", "http://p2"),
        decode=("http://d1",),
        max_attempts=max_attempts,
        pd_secret=SECRET,
        api_key=api_key,
    )
    return Router(cfg, transport=httpx.MockTransport(servers))


async def _route(r: Router) -> tuple[int, str]:
    resp = await r.route("/v1/completions", dict(BODY))
    if isinstance(resp, StreamingResponse):
        text = "".join([c async for c in resp.body_iterator])
        await resp.background()
        return resp.status_code, text
    return resp.status_code, resp.body.decode()


def _metric(r: Router, name: str, labels: dict | None = None) -> float:
    return r.registry.get_sample_value(name, labels) or 0.0


def test_failure_before_anything_streamed_is_retried_on_a_fresh_pair():
    servers = Servers(prefill_fails={"p1"})
    r = _router(servers)
    status, text = asyncio.run(_route(r))
    assert status == 200 and '"a"' in text and '"b"' in text and "error" not in text
    assert text.count('"a"') == 1  # the failed attempt put nothing in front of the client
    assert servers.calls[("p1", "/v1/completions")] == 1
    assert servers.calls[("p2", "/v1/completions")] == 1  # the retry went to the other prefill
    assert servers.calls[("d1", "/v1/completions")] == 2
    assert _metric(r, "kvrelay_router_retries_total") == 1
    assert _metric(r, "kvrelay_router_failures_total", {"cause": "peer_connection_lost"}) == 1


def test_failure_after_streaming_began_is_an_sse_error_not_a_retry():
    servers = Servers(decode_breaks=True)
    r = _router(servers)
    status, text = asyncio.run(_route(r))
    events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
    assert status == 200
    assert events[0]["choices"][0]["text"] == "a"
    assert events[-1]["error"]["code"] == "stream_broken"
    assert servers.calls[("d1", "/v1/completions")] == 1  # no second attempt
    assert _metric(r, "kvrelay_router_retries_total") == 0
    assert _metric(r, "kvrelay_router_failures_total", {"cause": "stream_broken"}) == 1


def test_first_event_error_keeps_its_status_and_pair_info_is_fetched_again():
    """A timeout reported as decode's first event is a 504 (nothing was streamed yet); after a
    failed attempt the router asks the pair for /pd/info again (a restarted decode has a new
    transfer address), even with one attempt per request."""
    servers = Servers(first_error="transfer_timeout")
    r = _router(servers, max_attempts=1)
    status, text = asyncio.run(_route(r))
    assert status == 504 and "transfer_timeout" in text
    servers.first_error = None
    servers.info_version = 1
    status, _ = asyncio.run(_route(r))
    assert status == 200
    assert servers.calls[("d1", "/pd/info")] == 2
    assert r.info["http://d1"].transfer_addr == "d1:9001"


def test_the_routers_api_key_goes_to_every_server_call():
    servers = Servers()
    status, _ = asyncio.run(_route(_router(servers, api_key="sk-stack")))
    assert status == 200 and servers.auth == {"Bearer sk-stack"}
    assert {path for _, path in servers.calls} == {"/pd/info", "/v1/completions"}


def test_outcomes_ok_error_and_client_disconnected_are_told_apart():
    r = _router(Servers())
    status, text = asyncio.run(_route(r))
    assert status == 200 and text.endswith("data: [DONE]\n\n")
    assert _metric(r, "kvrelay_router_requests_total", {"outcome": "ok"}) == 1

    async def leave_after_first_event(router: Router) -> None:
        resp = await router.route("/v1/completions", dict(BODY))
        events = resp.body_iterator
        assert '"a"' in await anext(events)
        await events.aclose()  # the client went away mid-stream
        await resp.background()

    asyncio.run(leave_after_first_event(r))
    assert _metric(r, "kvrelay_router_requests_total", {"outcome": "client_disconnected"}) == 1
    assert _metric(r, "kvrelay_router_client_disconnects_total") == 1
    assert _metric(r, "kvrelay_router_requests_total", {"outcome": "ok"}) == 1  # not counted ok

    async def leave_on_done(router: Router) -> float:
        """As the openai SDK does: stop reading at [DONE], before decode's stream ends."""
        resp = await router.route("/v1/completions", dict(BODY))
        events = resp.body_iterator
        async for event in events:
            if event.startswith("data: [DONE]"):
                break
        ok_when_seen = _metric(router, "kvrelay_router_requests_total", {"outcome": "ok"})
        await events.aclose()
        await resp.background()
        return ok_when_seen

    assert asyncio.run(leave_on_done(r)) == 2  # counted before the client could read the metric
    assert _metric(r, "kvrelay_router_requests_total", {"outcome": "ok"}) == 2
    assert _metric(r, "kvrelay_router_requests_total", {"outcome": "client_disconnected"}) == 1
    assert _metric(r, "kvrelay_router_inflight_requests") == 0

    broken = _router(Servers(decode_breaks=True))
    status, text = asyncio.run(_route(broken))
    assert '"stream_broken"' in text and text.endswith("data: [DONE]\n\n")  # error event, [DONE]
    assert _metric(broken, "kvrelay_router_requests_total", {"outcome": "error"}) == 1
    assert _metric(broken, "kvrelay_router_requests_total", {"outcome": "ok"}) == 0


def test_a_decode_slower_than_the_request_timeout_is_a_504_tried_once():
    """Slow is not unreachable: a read timeout is 504 decode_timeout, and the timeout being end
    to end, no second attempt doubles the wait."""
    calls = defaultdict(int)

    async def slow_decode(request: httpx.Request) -> httpx.Response:
        calls[request.url.host] += 1
        if request.url.path == "/pd/info":
            role = "prefill" if request.url.host.startswith("p") else "decode"
            return httpx.Response(
                200, json={"role": role, "instance_id": "i", "transfer_addr": "a"}
            )
        if request.url.host.startswith("p"):
            await asyncio.sleep(5)  # prefill never finishes first: decode's timeout decides
            return httpx.Response(200, json={})
        raise httpx.ReadTimeout("timed out", request=request)

    cfg = RouterConfig(prefill=("http://p1",), decode=("http://d1",), pd_secret=SECRET)
    r = Router(cfg, transport=httpx.MockTransport(slow_decode))
    status, text = asyncio.run(_route(r))
    assert status == 504 and json.loads(text)["error"]["code"] == "decode_timeout", text
    assert "--request-timeout" in json.loads(text)["error"]["message"]
    assert calls["d1"] == 2  # /pd/info and one attempt
    assert _metric(r, "kvrelay_router_retries_total") == 0
    assert _metric(r, "kvrelay_router_failures_total", {"cause": "decode_timeout"}) == 1


def test_past_the_limit_a_503_with_retry_after_and_the_slot_comes_back():
    servers = Servers()
    cfg = RouterConfig(
        prefill=("http://p1",), decode=("http://d1",), pd_secret=SECRET, max_concurrent_requests=1
    )
    r = Router(cfg, transport=httpx.MockTransport(servers))

    async def main():
        first = await r.route("/v1/completions", dict(BODY))  # a stream holds its slot
        assert isinstance(first, StreamingResponse) and r.inflight == 1
        second = await r.route("/v1/completions", dict(BODY))
        assert second.status_code == 503 and second.headers["retry-after"] == "1"
        assert json.loads(second.body)["error"]["code"] == "overloaded"
        text = "".join([c async for c in first.body_iterator])
        await first.background()
        assert '"b"' in text and r.inflight == 0  # the stream's end gave the slot back
        assert (await _route(r))[0] == 200

    asyncio.run(main())
    assert _metric(r, "kvrelay_router_requests_total", {"outcome": "overloaded"}) == 1
    assert _metric(r, "kvrelay_router_requests_total", {"outcome": "ok"}) == 2
