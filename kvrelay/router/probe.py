"""The router's view of its servers: a background task asks each server's `/ready` and `/load`
every interval on a client of its own, so that the router's `/health` and `/ready` answer from
what it keeps and never wait in the request pool behind traffic (past 100 requests that wait once
cost a stack its router: the launcher's probe timed out and restarted it with every request in
flight). Each server's last load report is kept with the time it came (server_load.py): the
routing policy balances by it while it is fresh."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from kvrelay.router.server_load import STALE_PROBES, ReportedLoad

log = logging.getLogger("kvrelay.router")


@dataclass
class ServerView:
    role: str
    ready: bool = False
    cause: str = "not probed yet"
    checked_at: float = 0.0  # monotonic time of the last answer (or failure)
    load: ReportedLoad | None = None  # the last load report (kept, with its time, until the next)

    def as_dict(self, now: float) -> dict:
        age = round(now - self.checked_at, 3) if self.checked_at else None
        load = self.load.as_dict(now) if self.load is not None else None
        return {
            "role": self.role,
            "ready": self.ready,
            "cause": self.cause,
            "age_s": age,
            "load": load,
        }


def _cause_of(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}: {r.text[:200]}"


class ServerProbe:
    def __init__(
        self, prefill: tuple[str, ...], decode: tuple[str, ...], interval_s: float, headers: dict
    ) -> None:
        self.views = {u: ServerView("prefill") for u in prefill}
        self.views.update({u: ServerView("decode") for u in decode})
        self.interval_s = interval_s
        timeout = max(2.0, 2 * interval_s)
        # A report older than this is stale: a few probes missed (a probe waits for its slowest).
        self.stale_after_s = STALE_PROBES * interval_s + timeout
        self.client = httpx.AsyncClient(timeout=timeout, headers=headers)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.client.aclose()

    async def _loop(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(u) for u in self.views))

    async def _probe(self, url: str) -> None:
        v = self.views[url]
        (ready, cause), _ = await asyncio.gather(self._ready(url), self._load(url))
        if ready != v.ready and v.checked_at:
            log.info("server=%s role=%s ready=%s cause=%r", url, v.role, ready, cause)
        v.ready, v.cause, v.checked_at = ready, cause, time.monotonic()

    async def _ready(self, url: str) -> tuple[bool, str]:
        try:
            r = await self.client.get(url + "/ready")
            return r.status_code == 200, "" if r.status_code == 200 else _cause_of(r)
        except httpx.HTTPError as e:
            return False, f"no answer: {type(e).__name__}: {e}"

    async def _load(self, url: str) -> None:
        """The server's load report, kept when it is one; else the last stays (and goes stale)."""
        try:
            r = await self.client.get(url + "/load")
            if r.status_code == 200:
                self.views[url].load = ReportedLoad.parse(r.json(), time.monotonic())
        except (httpx.HTTPError, ValueError) as e:
            log.debug("server=%s no load report: %s", url, e)

    def loads(self) -> dict[str, ReportedLoad]:
        """Each server's last load report (stale ones too: the policy judges their age)."""
        return {u: v.load for u, v in self.views.items() if v.load is not None}

    def ready_urls(self, role: str) -> list[str]:
        return [u for u, v in self.views.items() if v.role == role and v.ready]

    def not_ready(self) -> list[str]:
        """Why the router cannot serve: a role without any ready server."""
        why = []
        for role in ("prefill", "decode"):
            if not self.ready_urls(role):
                causes = [f"{u}: {v.cause}" for u, v in self.views.items() if v.role == role]
                why.append(f"no {role} server is ready ({'; '.join(causes)})")
        return why

    def snapshot(self) -> dict:
        now = time.monotonic()
        return {u: v.as_dict(now) for u, v in self.views.items()}
