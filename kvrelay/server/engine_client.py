"""The API process's handle on the engine process: start it, send requests, route its outputs.

A watchdog notices an engine that died: every waiting request gets an error at once, and the
server reports itself unhealthy (503) instead of hanging; a standalone server (`kvrelay serve`)
then exits with code 3 after KVRELAY_ENGINE_DEATH_EXIT_S (default 2 s), so that whatever
supervises it (systemd, Kubernetes, `kvrelay up`) restarts it. So does an engine whose steps keep
failing (a sticky device error): its process lives, but it serves nothing. The engine loop sends
something at least every second (its steps, or a heartbeat); a loop silent for far longer than
its own longest recent step is stuck (a hung kernel, a stopped process): first not ready
(KVRELAY_READY_STALL_S), then not alive (KVRELAY_ENGINE_STALL_S), each at least that many times
the longest recent step, so that a slow or busy engine is never taken for a dead one.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from kvrelay.config import EngineConfig, env
from kvrelay.disagg.handshake import SERVER_VERIFIER
from kvrelay.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    EngineStats,
    FromEngine,
    PDParams,
    RequestOutput,
    SamplingParams,
    SetStepProfile,
    Shutdown,
    StepOutputs,
)
from kvrelay.engine.process import engine_main
from kvrelay.server.load_report import PromptBacklog

log = logging.getLogger("kvrelay.api")

DEATH_EXIT_CODE = 3  # `kvrelay serve` whose engine process died
SHUTDOWN_GRACE_S = 10.0  # then it exits whatever its connections do


class EngineDead(Exception):
    pass


def pd_request_events() -> dict[str, int]:
    """PD request tokens this process refused (handshake.SERVER_VERIFIER), as bootstrap events:
    pd_request_replayed, pd_request_stale, pd_request_bad; zeros left out."""
    counts = SERVER_VERIFIER.take_counts()
    return {f"pd_request_{k}": v for k, v in counts.items() if v and k != "ok"}


def _engine_process(cfg: EngineConfig, in_addr: str, out_addr: str) -> None:
    """The engine process's entry point (spawned): the engine loop, with the PD agent factory.
    The engine layer may not import disagg/ (pyproject's layer contract), the server may; the
    import is here, in the child, so that the API process does not load torch with it."""
    from kvrelay.disagg.connector import make_agent

    engine_main(cfg, in_addr, out_addr, make_agent)


class EngineClient:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self._dir = tempfile.mkdtemp(prefix="kvrelay-")
        self._zctx = zmq.asyncio.Context()
        self._to = self._zctx.socket(zmq.PUSH)
        self._to.bind(f"ipc://{self._dir}/to_engine")
        self._from = self._zctx.socket(zmq.PULL)
        self._from.bind(f"ipc://{self._dir}/from_engine")
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(FromEngine)
        self.proc = mp.get_context("spawn").Process(
            target=_engine_process,
            args=(cfg, f"ipc://{self._dir}/to_engine", f"ipc://{self._dir}/from_engine"),
            daemon=True,
            name="kvrelay-engine",
        )
        self.queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        self.stats: EngineStats | None = None
        self.on_step = None  # callback(StepOutputs), set by the API for metrics
        self._tasks: list[asyncio.Task] = []
        self.max_failed_steps = int(env("KVRELAY_HEALTH_MAX_FAILED_STEPS"))
        self.ready_stall_s = float(env("KVRELAY_READY_STALL_S"))
        self.alive_stall_s = float(env("KVRELAY_ENGINE_STALL_S"))
        self.last_heard = time.monotonic()  # the last message from the engine loop
        self.recent_step_s: deque[float] = deque(maxlen=256)  # batch steps only
        # Set by a standalone server (cli.py): stops it, to exit DEATH_EXIT_CODE, once the
        # engine died (None: the server stays up and answers 503).
        self.on_death = None
        self.death_exit_s = float(env("KVRELAY_ENGINE_DEATH_EXIT_S"))
        self.exit_code = 0
        self._api_events: dict[str, int] = {}  # PD request refusals last shown in the stats
        self.backlog = PromptBacklog()  # prompt tokens not yet prefilled (GET /load)

    @property
    def healthy(self) -> bool:
        """The engine process runs (requests can be sent to it)."""
        return self.ready is not None and self.dead_reason is None and self.proc.is_alive()

    def unhealthy_reason(self) -> str | None:
        """Why this server cannot serve (None: it can): not started, dead, or failing every step.
        Cheap: the latest stats the engine sent, no round trip."""
        if not self.healthy:
            if self.ready is not None and self.dead_reason is None:  # the watchdog has not run yet
                return f"engine process died (exit code {self.proc.exitcode})"
            return self.dead_reason or "engine not ready"
        failed = self.stats.failed_steps if self.stats is not None else 0
        if self.max_failed_steps > 0 and failed >= self.max_failed_steps:
            return f"engine steps failing: the last {failed} in a row failed"
        return self._stalled(self.alive_stall_s, 50)

    def not_ready_reason(self) -> str | None:
        """Why this server should get no new requests now (None: it should), also cheap."""
        return self.unhealthy_reason() or self._stalled(self.ready_stall_s, 10)

    def _stalled(self, floor_s: float, steps: int) -> str | None:
        """The loop is silent past max(floor_s, `steps` x its longest recent step); 0: never."""
        if floor_s <= 0:
            return None
        longest = max(self.recent_step_s, default=0.0)
        deadline = max(floor_s, steps * longest)
        silent = time.monotonic() - self.last_heard
        if silent <= deadline:
            return None
        return (
            f"engine loop stalled: silent for {silent:.1f}s (deadline {deadline:.1f}s: "
            f"max({floor_s:g}s, {steps} x its longest recent step {longest * 1e3:.0f} ms))"
        )

    async def start(self, timeout_s: float) -> EngineReady:
        self.proc.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.ready is None:
            if not self.proc.is_alive():
                raise EngineDead(
                    f"engine process exited with code {self.proc.exitcode} while starting"
                )
            if loop.time() > deadline:
                raise EngineDead(f"engine did not start within {timeout_s:.0f}s")
            if await self._from.poll(500):
                msg = self._dec.decode(await self._from.recv())
                if isinstance(msg, EngineFailed):
                    raise EngineDead(f"engine failed to start: {msg.message}")
                if isinstance(msg, EngineReady):
                    self.ready = msg
                    self.last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]
        return self.ready

    def _with_api_events(self, stats: EngineStats) -> EngineStats:
        """The engine's bootstrap events and this process's PD request refusals beside them."""
        self._api_events = pd_request_events()
        if self._api_events:
            stats.pd_bootstrap = {**(stats.pd_bootstrap or {}), **self._api_events}
        return stats

    async def _read(self) -> None:
        while True:
            msg = self._dec.decode(await self._from.recv())
            self.last_heard = time.monotonic()
            if not isinstance(msg, StepOutputs):
                continue
            if msg.stats is None and not msg.outputs:  # a heartbeat of an idle loop
                if (
                    self.stats is not None
                    and self.on_step
                    and pd_request_events() != self._api_events
                ):
                    # New refusals show within a heartbeat: the last stats again, with nothing
                    # that would be observed twice (timings, step time, components).
                    again = msgspec.structs.replace(
                        self.stats, batch_size=0, components=None, pd_timings=None
                    )
                    self.on_step(StepOutputs([], self._with_api_events(again)))
                continue
            if msg.stats is not None:
                self._with_api_events(msg.stats)
                self.stats = msg.stats
                if msg.stats.batch_size:
                    self.recent_step_s.append(msg.stats.step_ms / 1e3)
            if self.on_step is not None:
                self.on_step(msg)
            for out in msg.outputs:
                self.backlog.started(out.rid)
                q = self.queues.get(out.rid)
                if q is not None:
                    q.put_nowait(out)

    async def _watch(self) -> None:
        while self.proc.is_alive():
            await asyncio.sleep(0.5)
        self.dead_reason = f"engine process died (exit code {self.proc.exitcode})"
        log.error("%s; failing %d in-flight requests", self.dead_reason, len(self.queues))
        for rid, q in list(self.queues.items()):
            q.put_nowait(RequestOutput(rid, [], finish_reason="error", error=self.dead_reason))
        if self.on_death is not None and self.death_exit_s > 0:
            await asyncio.sleep(self.death_exit_s)  # /health says why meanwhile
            self.exit_code = DEATH_EXIT_CODE
            log.error(
                "exiting: %s; a supervisor restarts this server exit_code=%d",
                self.dead_reason,
                DEATH_EXIT_CODE,
            )
            # The HTTP server's graceful shutdown; a client holding a connection open cannot
            # keep the process up past SHUTDOWN_GRACE_S.
            backstop = threading.Timer(SHUTDOWN_GRACE_S, os._exit, (DEATH_EXIT_CODE,))
            backstop.daemon = True  # a clean stop first; this only if the stop hangs
            backstop.start()
            self.on_death()

    async def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        pd: PDParams | None = None,
        group: str | None = None,
    ) -> asyncio.Queue:
        if not self.healthy:
            raise EngineDead(self.dead_reason or "engine is not running")
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.queues[rid] = q
        self.backlog.add(rid, len(prompt_ids))
        await self._to.send(self._enc.encode(AddRequest(rid, prompt_ids, params, pd, group)))
        return q

    async def abort(self, rid: str) -> None:
        if self.queues.pop(rid, None) is not None and self.healthy:
            await self._to.send(self._enc.encode(AbortRequest(rid)))

    async def set_step_profile(self, every: int) -> None:
        if not self.healthy:
            raise EngineDead(self.dead_reason or "engine is not running")
        await self._to.send(self._enc.encode(SetStepProfile(every)))

    def release(self, rid: str) -> None:
        self.queues.pop(rid, None)

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.proc.is_alive():
            await self._to.send(self._enc.encode(Shutdown()))
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
        self._zctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
