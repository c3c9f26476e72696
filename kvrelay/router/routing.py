"""One PD request routed: pick a (prefill, decode) pair (policy.py, among the servers ready at
the last probe, probe.py), mint the request id and the transfer id, POST the request to both with
the `kvrelay_pd` field (decode reserves KV and waits; prefill reserves on decode, computes the
prompt, ships KV + first token), and answer decode's reply, or stream it (relay.py). Any failure
becomes an OpenAI-format error naming its cause (RouteError; an SSE error event once streaming
has begun). A failed attempt is retried on a fresh pair only while nothing has been streamed to
the client. The PD fields of each request are signed with the PD secret (the `X-Kvrelay-PD-Auth`
header over the exact body bytes): servers take them from no one else. Outcomes counted: ok,
error, client_disconnected (the client left first), overloaded (past --max-concurrent-requests:
503 with Retry-After)."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.background import BackgroundTask

from kvrelay.config import RouterConfig
from kvrelay.disagg.handshake import PD_AUTH_HEADER, request_token
from kvrelay.disagg.protocol import pd_status
from kvrelay.router import prompt_logprobs
from kvrelay.router.lanes import ClientLanes
from kvrelay.router.policy import RoutingPolicy, block_hashes, prompt_text
from kvrelay.router.probe import ServerProbe
from kvrelay.router.relay import Relay

log = logging.getLogger("kvrelay.router")

RETRYABLE = {502, 503, 504}
# The request timeout is end to end: an attempt that used it up is not tried again.
NOT_RETRIED = {"prefill_timeout", "decode_timeout"}


class RouteError(Exception):
    def __init__(self, status: int, message: str, cause: str, retry_after_s: int = 0) -> None:
        super().__init__(message)
        self.status, self.message, self.cause = status, message, cause
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": None, "code": self.cause}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass
class PeerInfo:
    role: str
    instance_id: str
    transfer_addr: str


def _error_of(resp_status: int, body: bytes, side: str) -> RouteError:
    try:
        err = json.loads(body)["error"]
        msg, code = err.get("message", ""), err.get("code")
    except (ValueError, KeyError, TypeError):
        msg, code = body.decode(errors="replace")[:500], None
    return RouteError(resp_status, f"{side}: {msg}", code or f"{side}_error")


class Router:
    def __init__(
        self, cfg: RouterConfig, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        if not cfg.prefill or not cfg.decode:
            raise ValueError("the router needs at least one prefill and one decode server")
        self.cfg = cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        # Two connections per request in flight (prefill and decode): one client of httpx's
        # default 100 would queue requests past 50 behind one another, and one of 2 x the limit
        # would walk its whole pool on every request (lanes.py).
        self.lanes = ClientLanes(
            lambda n: httpx.AsyncClient(
                timeout=timeout,
                headers=headers,
                # Idle connections expire long before the servers' own keep-alive (cli.py's
                # KEEP_ALIVE_S): reusing one the server is closing fails the request.
                limits=httpx.Limits(
                    max_connections=n, max_keepalive_connections=n, keepalive_expiry=2.0
                ),
                transport=transport,  # tests: scripted servers
            )
        )
        self.client = self.lanes.clients[0]  # GETs: pair info, models
        self.probe = ServerProbe(cfg.prefill, cfg.decode, cfg.probe_interval_s, headers)
        self.info: dict[str, PeerInfo] = {}
        self.policy = RoutingPolicy(cfg.policy, stale_after_s=self.probe.stale_after_s)
        self.inflight = 0  # requests admitted and not yet answered (a stream: until it ends)
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvrelay_router_requests", "requests by outcome", ["outcome"], registry=r
        )
        self.failures = Counter(
            "kvrelay_router_failures", "failed attempts by cause", ["cause"], registry=r
        )
        self.retries = Counter(
            "kvrelay_router_retries", "attempts retried on a fresh pair", registry=r
        )
        self.disconnects = Counter(
            "kvrelay_router_client_disconnects",
            "streams the client left before their end (decode's request is aborted)",
            registry=r,
        )
        Gauge(
            "kvrelay_router_inflight_requests", "requests admitted and not yet answered", registry=r
        ).set_function(lambda: self.inflight)
        self.prompt_blocks = Counter(
            "kvrelay_router_prompt_blocks",
            "prompt blocks (64 characters) of the requests routed, by side",
            ["role"],
            registry=r,
        )
        self.matched_blocks = Counter(
            "kvrelay_router_matched_blocks",
            "of those, blocks the chosen server was believed to hold (sent there before)",
            ["role"],
            registry=r,
        )

    def pick(
        self, hashes: list[int] | None = None, avoid: set[str] = frozenset()
    ) -> tuple[str, str]:
        """A prefill and a decode server by the routing policy (balancing by this router's
        requests in flight and the servers' last load reports), among those ready at the last
        probe (all of them when none was: the attempt then fails with the cause) and not in
        `avoid` (servers an earlier attempt of this request failed on) while others remain."""
        hashes = hashes or []
        reported = self.probe.loads()
        pair = []
        for role, every in (("prefill", self.cfg.prefill), ("decode", self.cfg.decode)):
            ready = self.probe.ready_urls(role) or list(every)
            fresh = [u for u in ready if u not in avoid] or ready
            url, matched = self.policy.choose(role, fresh, hashes, reported)
            self.prompt_blocks.labels(role=role).inc(len(hashes))
            self.matched_blocks.labels(role=role).inc(matched)
            pair.append(url)
        return pair[0], pair[1]

    def release(self, lane: int) -> None:
        self.inflight -= 1
        self.lanes.release(lane)

    async def peer_info(self, url: str, role: str) -> PeerInfo:
        if url in self.info:
            return self.info[url]
        try:
            r = await self.client.get(url + "/pd/info", timeout=self.cfg.connect_timeout_s)
            r.raise_for_status()
            d = r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise RouteError(
                503, f"{role} server {url} is unreachable: {e}", f"{role}_unreachable"
            ) from None
        if d.get("role") != role:
            raise RouteError(503, f"{url} has role {d.get('role')!r}, not {role}", "role_mismatch")
        info = self.info[url] = PeerInfo(d["role"], d["instance_id"], d.get("transfer_addr", ""))
        return info

    async def route(self, path: str, body: dict, request: Request | None = None) -> Response:
        """Route one request; the outcome is counted here, or by the Relay once a stream ends."""
        if not self.cfg.pd_secret:
            self.requests.labels(outcome="error").inc()
            return RouteError(
                503,
                "the router has no PD secret (--pd-secret, --pd-secret-file or "
                "KVRELAY_PD_SECRET): PD servers would refuse its requests",
                "pd_secret_missing",
            ).response()
        if self.inflight >= self.cfg.max_concurrent_requests:
            self.requests.labels(outcome="overloaded").inc()
            self.failures.labels(cause="overloaded").inc()
            log.warning(
                "overloaded inflight=%d limit=%d", self.inflight, self.cfg.max_concurrent_requests
            )
            return RouteError(
                503,
                f"the router has {self.inflight} requests in flight, its limit "
                "(--max-concurrent-requests): retry later",
                "overloaded",
                retry_after_s=1,
            ).response()
        self.inflight += 1
        lane = self.lanes.acquire()
        streaming = False
        try:
            resp = await self._route(path, body, request, lane)
            streaming = isinstance(resp, StreamingResponse)
            return resp
        finally:
            if not streaming:  # a stream's Relay releases its lane when it ends
                self.release(lane)

    async def route_prefill_only(
        self, path: str, body: dict, request: Request | None = None
    ) -> Response:
        """A request that generates nothing (completions' max_tokens 0 with echo: the prompt's
        scores are the answer) needs no decode: a prefill server answers it as one server does
        (a plain request, no PD fields; it runs the prompt, which is all there is to do)."""
        url = self.pick()[0] + path
        client = self.lanes.clients[0]
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        try:
            if not body.get("stream"):
                r = await client.post(url, content=data, headers=headers)
                self.requests.labels(outcome="ok" if r.status_code == 200 else "error").inc()
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            resp = await client.send(
                client.build_request("POST", url, content=data, headers=headers), stream=True
            )
        except httpx.HTTPError as e:
            self.requests.labels(outcome="error").inc()
            return self._http_failure("prefill", e).response()
        if resp.status_code != 200:
            body_bytes = await resp.aread()
            await resp.aclose()
            self.requests.labels(outcome="error").inc()
            return Response(body_bytes, status_code=resp.status_code, media_type="application/json")
        self.requests.labels(outcome="ok").inc()

        async def events():
            try:
                async for line in resp.aiter_lines():
                    if line.strip():
                        yield line + "\n\n"
            finally:
                await resp.aclose()

        return StreamingResponse(
            events(), media_type="text/event-stream", background=BackgroundTask(resp.aclose)
        )

    async def _route(self, path: str, body: dict, request: Request | None, lane: int) -> Response:
        stream = bool(body.get("stream"))
        last: RouteError | None = None
        hashes = block_hashes(prompt_text(body)) if self.policy.name == "cache_aware" else []
        failed: set[str] = set()
        for attempt in range(max(self.cfg.max_attempts, 1)):
            if attempt:
                self.retries.inc()
            try:
                resp = await self._attempt(path, body, stream, lane, hashes, failed)
                if not isinstance(resp, StreamingResponse):  # a stream's Relay counts its own
                    gone = request is not None and await request.is_disconnected()
                    self.requests.labels(outcome="client_disconnected" if gone else "ok").inc()
                return resp
            except RouteError as e:
                self.failures.labels(cause=e.cause).inc()
                log.warning(
                    "attempt failed attempt=%d status=%d cause=%s message=%s",
                    attempt + 1,
                    e.status,
                    e.cause,
                    e.message,
                )
                last = e
                if e.status not in RETRYABLE or e.cause in NOT_RETRIED:
                    break
        assert last is not None
        self.requests.labels(outcome="error").inc()
        return last.response()

    async def _attempt(
        self, path: str, body: dict, stream: bool, lane: int, hashes: list[int], failed: set[str]
    ) -> Response:
        p_url, d_url = self.pick(hashes, failed)
        pair = (p_url, d_url)
        self.policy.begin(pair, hashes)  # ended here, or by the stream's Relay when it settles
        try:
            resp = await self._attempt_pair(path, body, stream, p_url, d_url, lane)
        except RouteError:
            self.policy.end(pair)
            failed.update(pair)
            # Either server may have restarted (new instance id and transfer address): ask again.
            self.info.pop(p_url, None)
            self.info.pop(d_url, None)
            raise
        except BaseException:
            self.policy.end(pair)
            raise
        if not isinstance(resp, StreamingResponse):  # a stream's Relay ends it when it settles
            self.policy.end(pair)
        return resp

    async def _attempt_pair(
        self, path: str, body: dict, stream: bool, p_url: str, d_url: str, lane: int
    ) -> Response:
        client = self.lanes.client(lane)
        await self.peer_info(p_url, "prefill")
        dinfo = await self.peer_info(d_url, "decode")
        rid = f"{'chatcmpl' if 'chat' in path else 'cmpl'}-{uuid.uuid4().hex}"
        tid = uuid.uuid4().hex
        dbody = {**body, "kvrelay_pd": {"role": "decode", "transfer_id": tid, "request_id": rid}}
        pbody = {
            **body,
            "stream": False,
            "kvrelay_pd": {
                "role": "prefill",
                "transfer_id": tid,
                "request_id": rid,
                "decode_addr": dinfo.transfer_addr,
                "decode_instance": dinfo.instance_id,
            },
        }
        pbody.pop("stream_options", None)
        log.info(
            "route rid=%s transfer_id=%s prefill=%s decode=%s stream=%s",
            rid,
            tid,
            p_url,
            d_url,
            stream,
        )
        dtask = asyncio.create_task(
            client.send(self._signed(client, d_url + path, dbody), stream=True)
        )
        ptask = asyncio.create_task(self._prefill(client, p_url + path, pbody))
        dresp: httpx.Response | None = None
        scores = prompt_logprobs.needed(path, body)  # prefill's part of the answer
        patch = None
        try:
            dresp = await self._race(dtask, ptask, rid)
            if dresp.status_code != 200:
                raise _error_of(dresp.status_code, await dresp.aread(), "decode")
            if not stream:
                data = await dresp.aread()
                await dresp.aclose()
                if scores:
                    data = prompt_logprobs.merge_body(path, body, data, await ptask)
                else:
                    asyncio.create_task(self._drain(ptask, rid))
                return Response(data, media_type="application/json")
            lines = dresp.aiter_lines()
            first = await self._race(asyncio.create_task(self._next_event(lines)), ptask, rid)
            if first is None:
                raise RouteError(502, "decode closed the stream before any event", "stream_broken")
            if first.startswith('data: {"error"'):
                # Nothing reached the client yet: the error can still be an HTTP status (504 for a
                # timeout), and the attempt can still be retried.
                err = json.loads(first[6:])["error"]
                code = err.get("code") or "decode_error"
                raise RouteError(pd_status(code), f"decode: {err.get('message')}", code)
            if (
                scores
            ):  # prefill answers once decode has its KV: about when decode's first event comes
                patch = prompt_logprobs.event_patcher(path, body, await ptask)
                first = patch(first)
        except BaseException:
            dtask.cancel()
            if dresp is not None:
                await dresp.aclose()
            if not ptask.done():
                ptask.cancel()
            raise
        if not scores:
            asyncio.create_task(self._drain(ptask, rid))
        relay = Relay(self, first, lines, dresp, rid, lane, patch, (p_url, d_url))
        # The background task runs even when the client left before the stream started, when the
        # generator's own cleanup never runs: it closes decode's response, which aborts the request.
        return StreamingResponse(
            relay.events(), media_type="text/event-stream", background=BackgroundTask(relay.close)
        )

    def _signed(self, client: httpx.AsyncClient, url: str, body: dict) -> httpx.Request:
        """A POST of `body` whose PD fields the server will take: signed with the PD secret."""
        data = json.dumps(body).encode()
        headers = {
            "Content-Type": "application/json",
            PD_AUTH_HEADER: request_token(self.cfg.pd_secret, data),
        }
        return client.build_request("POST", url, content=data, headers=headers)

    async def _prefill(self, client: httpx.AsyncClient, url: str, body: dict) -> bytes:
        """Prefill's answer (what it computed of the prompt: its scores, when asked)."""
        try:
            r = await client.send(self._signed(client, url, body))
        except httpx.HTTPError as e:
            raise self._http_failure("prefill", e) from None
        if r.status_code != 200:
            raise _error_of(r.status_code, r.content, "prefill")
        return r.content

    async def _race(self, task: asyncio.Task, ptask: asyncio.Task, rid: str):
        """Wait for `task`; a prefill failure that comes first wins (decode would only time out)."""
        while True:
            pending = {task} if ptask.done() else {task, ptask}
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if ptask in done and ptask.exception() is not None and task not in done:
                task.cancel()
                e = ptask.exception()
                log.warning("prefill failed rid=%s error=%s", rid, e)
                raise (
                    e
                    if isinstance(e, RouteError)
                    else RouteError(502, f"prefill: {e}", "prefill_error")
                )
            if task in done:
                try:
                    return task.result()
                except httpx.HTTPError as e:
                    raise self._http_failure("decode", e) from None

    def _http_failure(self, side: str, e: httpx.HTTPError) -> RouteError:
        """A server that answered too late is slow, not unreachable: 504, and not retried."""
        if isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout):
            return RouteError(
                504,
                f"{side} server did not answer within --request-timeout "
                f"({self.cfg.request_timeout_s:g}s): {type(e).__name__}",
                f"{side}_timeout",
            )
        return RouteError(
            502, f"{side} server failed: {type(e).__name__}: {e}", f"{side}_unreachable"
        )

    @staticmethod
    async def _next_event(lines) -> str | None:
        async for line in lines:
            if line.strip():
                return line
        return None

    async def _drain(self, ptask: asyncio.Task, rid: str) -> None:
        try:
            await ptask
        except RouteError as e:
            log.warning(
                "prefill failed after decode answered rid=%s cause=%s message=%s",
                rid,
                e.cause,
                e.message,
            )
        except asyncio.CancelledError:
            pass

    def not_ready(self) -> list[str]:
        """Why the router cannot serve now ([]: it can), from what it keeps."""
        why = [] if self.cfg.pd_secret else ["the router has no PD secret (--pd-secret)"]
        return why + self.probe.not_ready()
