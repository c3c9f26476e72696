"""`kvrelay router`: the OpenAI-compatible front of a PD deployment.

Per request: pick a (prefill, decode) pair, mint the request id and the transfer id, POST the
request to both with the `kvrelay_pd` field (decode reserves KV and waits; prefill reserves on
decode, computes the prompt, ships KV + first token), and stream decode's answer back. Any failure
becomes an OpenAI-format error naming its cause (an SSE error event once streaming has begun).
A failed attempt is retried on a fresh pair only while nothing has been streamed to the client.
The PD fields of each request are signed with the PD secret (the `X-Kvrelay-PD-Auth` header over
the exact body bytes): servers take them from no one else. With an API key, clients must send it
(guard.py) and the router sends it to the servers. Bodies are validated as the servers do
(server/validation.py) before anything is routed, and every answer, 404 and 500 included, is an
OpenAI error. Outcomes counted: ok, error, client_disconnected (the client left first),
overloaded (past --max-concurrent-requests: 503 with Retry-After), and http_<status> for what
never reached routing.
`/health` says the router is alive; `/ready` says it can serve (its PD secret is set and at least
one prefill and one decode server answered their own `/ready` in the last background probe).
Both answer from state the router keeps (router_probe.py), never from a request behind traffic.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.background import BackgroundTask

from kvrelay.config import RouterConfig, redacted
from kvrelay.disagg import router_fanout, router_metrics, router_prompt_logprobs
from kvrelay.disagg.handshake import PD_AUTH_HEADER, request_token
from kvrelay.disagg.protocol import pd_status
from kvrelay.disagg.router_lanes import ClientLanes
from kvrelay.disagg.router_policy import RoutingPolicy, block_hashes, prompt_text
from kvrelay.disagg.router_probe import ServerProbe
from kvrelay.server import prompt_logprobs
from kvrelay.server.errors import install_error_handlers
from kvrelay.server.guard import HttpGuard
from kvrelay.server.openapi_doc import document_bodies
from kvrelay.server.schemas import ChatCompletionRequest, CompletionRequest
from kvrelay.server.sglang_api import GenerateRequest
from kvrelay.server.validation import parse_json, validate

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
        # would walk its whole pool on every request (router_lanes.py).
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
        self.policy = RoutingPolicy(cfg.policy)
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
        """A prefill and a decode server by the routing policy, among those ready at the last
        probe (all of them when none was: the attempt then fails with the cause) and not in
        `avoid` (servers an earlier attempt of this request failed on) while others remain."""
        hashes = hashes or []
        pair = []
        for role, every in (("prefill", self.cfg.prefill), ("decode", self.cfg.decode)):
            ready = self.probe.ready_urls(role) or list(every)
            fresh = [u for u in ready if u not in avoid] or ready
            url, matched = self.policy.choose(role, fresh, hashes)
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
        scores = router_prompt_logprobs.needed(path, body)  # prefill's part of the answer
        patch = None
        try:
            dresp = await self._race(dtask, ptask, rid)
            if dresp.status_code != 200:
                raise _error_of(dresp.status_code, await dresp.aread(), "decode")
            if not stream:
                data = await dresp.aread()
                await dresp.aclose()
                if scores:
                    data = router_prompt_logprobs.merge_body(path, body, data, await ptask)
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
                patch = router_prompt_logprobs.event_patcher(path, body, await ptask)
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


class Relay:
    """Decode's SSE stream, relayed to the client; a broken decode stream becomes an error event."""

    def __init__(
        self,
        router: Router,
        first: str,
        lines,
        dresp: httpx.Response,
        rid: str,
        lane: int,
        patch=None,
        pair: tuple[str, str] = (),
    ) -> None:
        self.router, self.first, self.lines, self.dresp, self.rid = router, first, lines, dresp, rid
        self.lane, self.pair = lane, pair  # the pair's load counts until the stream settles
        self.patch = patch  # puts prefill's prompt scores into decode's events (None: none)
        self.ended = False  # decode's stream reached its end (or broke): the client saw it all
        self.broken = False  # decode's stream broke (the client got an error event)
        self.closed = False
        self.settled = False

    async def events(self):
        try:
            yield self.first + "\n\n"
            try:
                async for line in self.lines:
                    if line.strip() == "data: [DONE]":
                        # Settled before the client sees it: a client that leaves on [DONE]
                        # (the openai SDK does) got everything and must count as ok.
                        self.ended = True
                        self.settle()
                        yield line + "\n\n"
                        return
                    if line.strip():
                        yield (self.patch(line) if self.patch else line) + "\n\n"
            except httpx.HTTPError as e:
                self.router.failures.labels(cause="stream_broken").inc()
                log.warning("decode stream broke rid=%s error=%s", self.rid, e)
                err = {
                    "message": f"decode stream broke: {type(e).__name__}: {e}",
                    "type": "server_error",
                    "code": "stream_broken",
                }
                self.broken = True
                yield f"data: {json.dumps({'error': err})}\n\n"
                self.ended = True
                self.settle()
                yield "data: [DONE]\n\n"
            self.ended = True
        finally:
            await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.ended:
            self.router.disconnects.inc()
            log.info("client disconnected, aborting rid=%s", self.rid)
        self.settle()
        await self.dresp.aclose()

    def settle(self) -> None:
        """Count the outcome and free the request's slot, once."""
        if self.settled:
            return
        self.settled = True
        outcome = "error" if self.broken else "ok" if self.ended else "client_disconnected"
        self.router.requests.labels(outcome=outcome).inc()
        self.router.release(self.lane)
        self.router.policy.end(self.pair)


def create_router_app(cfg: RouterConfig, on_ready=None) -> FastAPI:
    router = Router(cfg)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is ours, with ids

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        router.probe.start()
        if on_ready is not None:
            on_ready()
        yield
        await router.probe.close()
        await router.lanes.aclose()

    app = FastAPI(title="kvrelay router", lifespan=lifespan)
    app.state.router = router

    def count(status: int) -> None:
        router.requests.labels(outcome=f"http_{status}").inc()

    app.add_middleware(
        HttpGuard, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes, on_reject=count
    )
    install_error_handlers(app, count)
    if not cfg.pd_secret:
        log.warning(
            "no PD secret (--pd-secret, --pd-secret-file or KVRELAY_PD_SECRET): every request "
            "is answered 503, the servers would refuse it"
        )

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        """Liveness: the router answers. Its servers' last probe is shown, not waited for."""
        return JSONResponse({"status": "alive", "servers": router.probe.snapshot()})

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready():
        """Readiness: the router can route (secret set, a prefill and a decode server ready)."""
        why = router.not_ready()
        if why:
            return RouteError(503, "; ".join(why), "not_ready").response()
        return JSONResponse({"status": "ready", "servers": router.probe.snapshot()})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        """The router's metrics, then its servers' (router_metrics.py: relabelled per server,
        each fetched within a short timeout)."""
        own = generate_latest(router.registry).decode()
        servers = [(u, "prefill") for u in cfg.prefill] + [(u, "decode") for u in cfg.decode]
        return PlainTextResponse(own + await router_metrics.servers_text(router.client, servers))

    @app.api_route("/ping", methods=["GET", "POST"], response_class=PlainTextResponse)
    async def ping():
        """Liveness (vLLM's /ping), as /health."""
        return PlainTextResponse("ok")

    async def from_decode(path: str, body: bytes | None = None) -> Response:
        """A read-only request answered by a decode server (they all serve one model and one
        tokenizer): the first ready one at the last probe."""
        url = (router.probe.ready_urls("decode") or cfg.decode)[0] + path
        try:
            if body is None:
                r = await router.client.get(url)
            else:
                headers = {"Content-Type": "application/json"}
                r = await router.client.post(url, content=body, headers=headers)
        except httpx.HTTPError as e:
            return RouteError(
                503, f"decode server unreachable: {e}", "decode_unreachable"
            ).response()
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/v1/models")
    async def models():
        return await from_decode("/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return await from_decode(f"/v1/models/{quote(model_id, safe='')}")

    @app.get("/version")
    async def version():
        return await from_decode("/version")

    @app.get("/server_info")
    async def server_info():
        """The router's configuration (secrets redacted) and each server's own /server_info
        (or why it could not be had): what `kvrelay repro --deterministic-check` and the ledger
        read through a router."""

        async def one(url: str):
            try:
                r = await router.client.get(url + "/server_info", timeout=cfg.connect_timeout_s)
                return r.json() if r.status_code == 200 else {"error": f"HTTP {r.status_code}"}
            except (httpx.HTTPError, ValueError) as e:
                return {"error": f"{type(e).__name__}: {e}"}

        urls = [*cfg.prefill, *cfg.decode]
        infos = await asyncio.gather(*(one(u) for u in urls))
        return {
            "role": "router",
            "config": redacted(asdict(cfg)),
            "servers": dict(zip(urls, infos, strict=True)),
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await from_decode("/tokenize", await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await from_decode("/detokenize", await request.body())

    async def _body(request: Request, schema) -> tuple[dict, object]:
        """The client's body, validated as the servers will (a 400 here costs no pair)."""
        body = parse_json(await request.body())
        body.pop("kvrelay_pd", None)  # only the router sets it
        req = validate(schema, body)
        if schema is not GenerateRequest:
            prompt_logprobs.check(req)  # what one server refuses, refused before routing
        return body, req

    async def handle(path: str, request: Request, schema) -> Response:
        """One PD request, or one per prompt and sample (router_fanout.py); a completion that
        generates nothing (max_tokens 0: the prompt's scores alone) is prefill's alone."""
        body, req = await _body(request, schema)
        route = router.route_prefill_only if body.get("max_tokens") == 0 else router.route
        subs = router_fanout.split(path, body, req)
        if subs is None:
            return await route(path, body, request)
        n = getattr(req, "n", 1)
        return await router_fanout.run(path, body, subs, n, lambda b: route(path, b, request))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle("/v1/chat/completions", request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("/v1/completions", request, CompletionRequest)

    @app.post("/generate")
    async def generate(request: Request):
        """SGLang's native generate, disaggregated like the OpenAI routes."""
        return await handle("/generate", request, GenerateRequest)

    routes = {
        ("POST", "/v1/chat/completions"): ChatCompletionRequest,
        ("POST", "/v1/completions"): CompletionRequest,
        ("POST", "/generate"): GenerateRequest,
    }
    document_bodies(app, routes, frozenset(routes))
    return app
