"""A standalone `kvrelay serve` whose engine process dies exits non-zero (code 3), so that any
supervisor (systemd, Kubernetes, `kvrelay up`) restarts it; until then /health says why.

Bound: the watchdog sees the death within 0.5 s, the server exits KVRELAY_ENGINE_DEATH_EXIT_S
later (1 s here) after a graceful stop (SHUTDOWN_GRACE_S at most): well under 10 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
from conftest import ServerProcess

from kvrelay.ops.procs import engine_pid


def test_a_server_whose_engine_was_killed_exits_3(monkeypatch):
    monkeypatch.setenv("KVRELAY_ENGINE_DEATH_EXIT_S", "1")
    s = ServerProcess(
        "--model", "qwen3-tiny", "--load-format", "dummy", "--max-total-tokens", "2048"
    )
    try:
        os.kill(engine_pid(s.proc.pid), signal.SIGKILL)
        killed = time.monotonic()
        said_why = False
        while s.proc.poll() is None and time.monotonic() - killed < 10:
            try:
                h = httpx.get(s.url + "/health", timeout=1)
                said_why |= h.status_code == 503 and "engine process died" in h.text
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        try:
            rc = s.proc.wait(timeout=max(0.1, 10 - (time.monotonic() - killed)))
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - killed
        assert rc == 3, (rc, s.log())
        assert said_why, s.log()  # /health named the cause before the exit
        assert took < 10, took
        print(f"\nengine SIGKILL -> exit 3 in {took:.1f} s")
        assert "exiting: engine process died" in s.log()
    finally:
        s.close()
