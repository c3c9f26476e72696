"""Supervision and health truth with real processes: /health turns 503 when engine steps keep
failing; `kvrelay up` gives up, exit 1, on a child that keeps dying. (A SIGKILLed engine restarted
by `kvrelay up` is in test_launcher.py's real-stack test, which shares its stack start.)"""

from __future__ import annotations

import os
import signal
import time

import httpx
from conftest import ServerProcess
from test_launcher import _fake_up

from kvrelay.ops.procs import engine_pid


def test_health_turns_503_once_steps_keep_failing():
    # From the first batch step on every forward raises, as after a sticky CUDA error: the
    # process lives, nothing is served. The default threshold is 3 failed steps in a row.
    s = ServerProcess(
        "--model", "smollm2", "--max-total-tokens", "4096", "--test-fault-sticky-error", "1"
    )
    try:
        body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2}
        for i in range(3):
            assert httpx.get(s.url + "/health", timeout=5).status_code == 200, i
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code >= 500 and "illegal memory access" in r.text, r.text
        h = httpx.get(s.url + "/health", timeout=5)
        assert h.status_code == 503, h.text
        assert "engine steps failing" in h.json()["error"]["message"]
        assert s.proc.poll() is None  # alive, and now honest about it
    finally:
        s.close()


def test_up_gives_up_on_a_child_that_keeps_dying(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_UP_MAX_RESTARTS", "2")
    up = _fake_up(tmp_path)
    try:
        up.wait_for(r"kvrelay up ready: ", 30)
        for n in (1, 2):
            os.kill(up.pid_of("router"), signal.SIGKILL)
            up.wait_for(rf"child=router exited rc=-9 .*action=restart .*restarts={n}", 10)
            up.wait_for(rf"child=router healthy pid=\d+ restarts={n}", 15)
        os.kill(up.pid_of("router"), signal.SIGKILL)
        up.wait_for(r"child=router exited rc=-9 restarts_in_window=3 .* action=give_up", 10)
        assert up.proc.wait(timeout=30) == 1
        assert any("shutdown done" in ln for ln in up.lines)
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


def test_restart_scope_stack_co_restarts_all_on_a_server_death(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_UP_RESTART_SCOPE", "stack")
    up = _fake_up(tmp_path)
    try:
        up.wait_for(r"kvrelay up ready: ", 30)
        first = {n: up.pid_of(n) for n in ("prefill", "decode", "router")}
        os.kill(first["prefill"], signal.SIGKILL)
        up.wait_for(r"child=prefill exited rc=-9 .*action=co-restart", 10)
        up.wait_for(r"co-restart begin", 10)
        up.wait_for(r"kvrelay up ready: ", 30)
        second = {n: up.pid_of(n) for n in first}
        assert all(second[n] != first[n] for n in first), (first, second)
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=30) == 0
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


def test_a_stopped_engine_turns_not_ready_then_not_alive_and_back(monkeypatch):
    """An engine loop that stops turning (SIGSTOP: a hung kernel looks the same from outside) is
    no longer hidden behind cached stats: /ready turns 503 past KVRELAY_READY_STALL_S, /health past
    KVRELAY_ENGINE_STALL_S, each naming the stall; both answer 200 again once it runs. A busy or
    idle engine is never taken for one: it heartbeats every second."""
    monkeypatch.setenv("KVRELAY_READY_STALL_S", "2")
    monkeypatch.setenv("KVRELAY_ENGINE_STALL_S", "4")
    s = ServerProcess("--model", "smollm2", "--max-total-tokens", "4096")
    engine = engine_pid(s.proc.pid)
    try:
        time.sleep(3)  # idle past the ready deadline: heartbeats keep it ready
        assert httpx.get(s.url + "/ready", timeout=5).status_code == 200
        os.kill(engine, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            ready = _first_503(s.url + "/ready", t0, 10)
            alive = _first_503(s.url + "/health", t0, 10)
        finally:
            os.kill(engine, signal.SIGCONT)
        # Deadlines count from the last heartbeat, up to 1 s before the stop.
        assert 0.9 < ready[0] < alive[0] < 8, (ready, alive)
        assert "engine loop stalled" in ready[1] and "engine loop stalled" in alive[1], alive
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            h, r = httpx.get(s.url + "/health", timeout=5), httpx.get(s.url + "/ready", timeout=5)
            if h.status_code == r.status_code == 200:
                break
            time.sleep(0.2)
        assert h.status_code == r.status_code == 200, (h.text, r.text)
        body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        s.close()


def _first_503(url: str, t0: float, within_s: float) -> tuple[float, str]:
    """Seconds since t0 until `url` first answers 503, and the cause it names."""
    while time.monotonic() - t0 < within_s:
        r = httpx.get(url, timeout=5)
        if r.status_code == 503:
            return time.monotonic() - t0, r.json()["error"]["message"]
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered 503 within {within_s}s")
