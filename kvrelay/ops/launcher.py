"""`kvrelay up`: start the router and its prefill and decode servers (one of each, or N and M
replicas: kvrelay/ops/stack.py lays them out) on one machine, health-gate, supervise, restart.

Each child runs in its own process group with its own log file. Start-up is gated on `/ready`
(every server first, then the router). Supervision probes liveness, `/health`, which a busy child
still answers 200: a child that exits unexpectedly is restarted on its same ports; so is one whose
`/health` answers 503 for KVRELAY_UP_UNHEALTHY_S after it was healthy (its engine died, every step
fails, or its loop is stalled far past its own longest step: the server applies that deadline),
and one that gives no answer at all for KVRELAY_UP_UNRESPONSIVE_S (a hung process; a loaded one
answers late, not never): that child alone (one replica: the router keeps routing to the others,
its probe leaves out a server that is not ready), or the whole stack (KVRELAY_UP_RESTART_SCOPE).
Readiness (`/ready` 503: busy, stalled briefly, no server behind the router) never restarts
anything. Restarts back off;
a child that needs more than KVRELAY_UP_MAX_RESTARTS within KVRELAY_UP_RESTART_WINDOW_S stops the
stack (exit 1) with a log line saying so. SIGHUP co-restarts the whole stack; SIGINT/SIGTERM stops
it (router first) and returns 0.
The stack's PD secret (and its API key, if any) reach the children through their environment
(KVRELAY_PD_SECRET, KVRELAY_API_KEY), never their command lines, which other users can read.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from kvrelay.ops.stack import ChildSpec, LaunchConfig, build_specs

log = logging.getLogger("kvrelay.launcher")

PR_SET_PDEATHSIG = 1
PROBE_S = 1.0  # /health of each running child, this often
KILL_GRACE_S = 5.0  # an unhealthy server gets this long to exit on SIGTERM: it serves nothing


class LaunchError(Exception):
    """The stack could not be brought up (a child died or did not become healthy)."""


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when the launcher dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen | None = None
    log_file: IO[str] | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0
    due_at: float | None = None  # when a crashed child is to be restarted
    healthy: bool = False  # has answered /health 200 since it was (re)started
    last_ok: float = 0.0  # when /health last answered 200
    next_probe: float = 0.0
    restart_times: list[float] = field(default_factory=list)  # within the restart window

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class Flags:
    stop: int = 0
    hup: bool = False


class Launcher:
    def __init__(
        self,
        cfg: LaunchConfig,
        on_ready: Callable[[str, str], None] | None = None,
        poll_s: float = 0.2,
    ) -> None:
        self.cfg = cfg
        self.on_ready = on_ready
        self.poll_s = poll_s
        self.flags = Flags()
        self.gave_up: str | None = None  # why the stack was given up on
        if cfg.restart_scope not in ("server", "stack"):
            raise ValueError(
                f"restart scope must be 'server' or 'stack', not {cfg.restart_scope!r}"
            )
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
        self.children = [Child(s) for s in build_specs(cfg)]
        self.by_name = {c.name: c for c in self.children}
        # One client for every probe: httpx.get builds a client (and its SSL context) per call,
        # ~30 ms of CPU, several times a second while the servers load on the same cores. No
        # keep-alive: each probe opens its own connection, as httpx.get did.
        self._http = httpx.Client(timeout=2.0, limits=httpx.Limits(max_keepalive_connections=0))

    @property
    def router_url(self) -> str:
        return self.by_name["router"].spec.url

    # ---- signals -------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        def stop(signum, _frame) -> None:
            self.flags.stop += 1
            log.info("signal=%s action=stop count=%d", signal.Signals(signum).name, self.flags.stop)

        def hup(_signum, _frame) -> None:
            self.flags.hup = True
            log.info("signal=SIGHUP action=co-restart")

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGHUP, hup)

    # ---- one child -------------------------------------------------------------------------------

    def _spawn(self, c: Child) -> None:
        c.log_file = open(c.spec.log_path, "a")  # noqa: SIM115 (kept open for the child's life)
        c.log_file.write(f"--- kvrelay up: starting {c.name} at {time.ctime()} ---\n")
        c.log_file.flush()
        c.proc = subprocess.Popen(
            c.spec.argv,
            env=c.spec.env,
            stdin=subprocess.DEVNULL,
            stdout=c.log_file,
            stderr=subprocess.STDOUT,
            process_group=0,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        c.started_at, c.healthy, c.due_at = time.monotonic(), False, None
        c.next_probe = c.started_at
        log.info(
            "child=%s pid=%d url=%s log=%s restarts=%d",
            c.name,
            c.proc.pid,
            c.spec.url,
            c.spec.log_path,
            c.restarts,
        )

    def _stop(self, c: Child, timeout: float) -> None:
        """SIGTERM the child (it stops its own engine), wait, then SIGKILL its whole group."""
        p = c.proc
        if p is None:
            return
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("child=%s pid=%d action=kill reason=stop_timeout", c.name, p.pid)
        self._kill_group(p.pid)
        p.wait()
        if c.log_file is not None:
            c.log_file.close()
            c.log_file = None
        c.proc, c.healthy = None, False
        log.info("child=%s pid=%d stopped rc=%s", c.name, p.pid, p.returncode)

    @staticmethod
    def _kill_group(pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _is_ready(self, c: Child) -> bool:
        return self._probe(c, "/ready")[0]

    def _probe(self, c: Child, path: str = "/health") -> tuple[bool, bool, str]:
        """(200, answered at all, the cause a 503 names)."""
        try:
            r = self._http.get(c.spec.url + path)
        except httpx.HTTPError as e:
            return False, False, f"no answer: {type(e).__name__}"
        if r.status_code == 200:
            return True, True, ""
        try:
            cause = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            cause = r.text[:200]
        return False, True, f"HTTP {r.status_code}: {cause}"

    def _wait_healthy(self, group: list[Child]) -> None:
        deadline = time.monotonic() + self.cfg.health_timeout_s
        while not all(c.healthy for c in group):
            if self.flags.stop:
                return
            for c in group:
                if c.healthy:
                    continue
                assert c.proc is not None
                if c.proc.poll() is not None:
                    raise LaunchError(
                        f"{c.name} exited with code {c.proc.returncode} before it was healthy; "
                        f"see {c.spec.log_path}"
                    )
                if self._is_ready(c):
                    c.healthy, c.last_ok = True, time.monotonic()
                    log.info("child=%s ready pid=%d", c.name, c.proc.pid)
            if time.monotonic() > deadline:
                late = [c.name for c in group if not c.healthy]
                raise LaunchError(f"not healthy within {self.cfg.health_timeout_s}s: {late}")
            time.sleep(self.poll_s)

    # ---- the stack ------------------------------------------------------------------------------

    def start_all(self) -> None:
        """Servers first (in parallel), then the router; returns once all are healthy."""
        servers = [c for c in self.children if c.spec.role != "router"]
        for c in servers:
            self._spawn(c)
        self._wait_healthy(servers)
        if self.flags.stop:
            return
        router = self.by_name["router"]
        self._spawn(router)
        self._wait_healthy([router])
        if not self.flags.stop:
            self._announce()

    def stop_all(self) -> None:
        for c in sorted(self.children, key=lambda c: c.spec.role != "router"):
            self._stop(c, self.cfg.stop_timeout_s)

    def _announce(self) -> None:
        model = "?"
        auth = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        try:
            decode = next(c for c in self.children if c.spec.role == "decode")
            url = decode.spec.url + "/pd/info"
            model = httpx.get(url, headers=auth, timeout=5).json()["model"]
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        log.info("stack ready router=%s model=%s", self.router_url, model)
        if self.on_ready is not None:
            self.on_ready(self.router_url, model)

    def supervise_once(self) -> None:
        """Notice crashed or unhealthy children, schedule and perform their restarts."""
        now = time.monotonic()
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                self._failed(c, f"exited rc={c.proc.returncode}", now)
            elif c.proc is not None and now >= c.next_probe:
                self._check(c, now)
            if self.gave_up or self.flags.hup:
                return
            if c.proc is None and c.due_at is not None and now >= c.due_at:
                c.restarts += 1
                self._spawn(c)

    def _check(self, c: Child, now: float) -> None:
        """Probe liveness (/health). A child that was healthy is restarted once it has answered
        503 for unhealthy_s (its engine died, every step fails, its loop is stalled past its own
        deadline: it serves nothing), or has not answered at all for unresponsive_s; so is a
        restarted one that never became healthy. A slow answer is not a failure."""
        c.next_probe = now + PROBE_S
        ok, answered, cause = self._probe(c)
        if ok:
            if not c.healthy:
                log.info("child=%s healthy pid=%d restarts=%d", c.name, c.proc.pid, c.restarts)
            c.healthy, c.last_ok = True, now
            return
        if c.healthy and answered:
            log.warning("child=%s not alive cause=%s", c.name, json.dumps(cause))
        deadline = self.cfg.unhealthy_s if answered else self.cfg.unresponsive_s
        if c.healthy and now - c.last_ok >= deadline:
            self._failed(c, f"unhealthy_s={now - c.last_ok:.1f} cause={json.dumps(cause)}", now)
        elif not c.healthy and now - c.started_at > self.cfg.health_timeout_s:
            self._failed(c, f"not healthy within {self.cfg.health_timeout_s:g}s", now)

    def _failed(self, c: Child, why: str, now: float) -> None:
        """Stop what is left of the child; restart it (or the stack) after a backoff, or give up."""
        uptime = now - c.started_at
        if c.proc is not None and c.proc.poll() is None:
            self._stop(c, KILL_GRACE_S)
        elif c.proc is not None:
            self._kill_group(c.proc.pid)  # an orphaned engine would hold the GPU and ports
            c.proc.wait()
            if c.log_file is not None:
                c.log_file.close()
                c.log_file = None
        c.proc, c.healthy = None, False
        window = self.cfg.restart_window_s
        c.restart_times = [t for t in c.restart_times if now - t < window] + [now]
        if len(c.restart_times) > self.cfg.max_restarts:
            self.gave_up = (
                f"child={c.name} {why} restarts_in_window={len(c.restart_times)} "
                f"window_s={window:g} max_restarts={self.cfg.max_restarts}"
            )
            log.error("%s action=give_up: stopping the stack", self.gave_up)
            return
        c.backoff_s = 0.5 if uptime > 60 else min(max(c.backoff_s * 2, 1.0), self.cfg.max_backoff_s)
        stack = self.cfg.restart_scope == "stack" and c.spec.role != "router"
        log.warning(
            "child=%s %s uptime_s=%.1f action=%s in_s=%.1f restarts=%d",
            c.name,
            why,
            uptime,
            "co-restart" if stack else "restart",
            0.0 if stack else c.backoff_s,
            c.restarts + 1,
        )
        if stack:
            self.flags.hup = True  # run() co-restarts prefill, decode and router
        else:
            c.due_at = now + c.backoff_s

    def run(self) -> int:
        """Start, supervise until SIGINT/SIGTERM, stop. 0 on a clean stop, 1 if startup failed."""
        self.install_signal_handlers()
        try:
            try:
                self.start_all()
            except LaunchError as e:
                log.error("startup failed error=%s", e)
                return 1
            while not self.flags.stop:
                if self.gave_up:
                    log.error("gave up: %s", self.gave_up)
                    return 1
                if self.flags.hup:
                    self.flags.hup = False
                    log.info("co-restart begin")
                    self.stop_all()
                    try:
                        self.start_all()
                    except LaunchError as e:
                        log.error("co-restart failed error=%s", e)
                        return 1
                    continue
                self.supervise_once()
                time.sleep(self.poll_s)
            return 0
        finally:
            log.info("shutdown begin")
            self.stop_all()
            log.info("shutdown done")
