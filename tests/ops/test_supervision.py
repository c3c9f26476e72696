"""Supervision and health truth with real processes: /health turns 503 when engine steps keep
failing; `kvrelay up` gives up, exit 1, on a child that keeps dying. (A SIGKILLed engine restarted
by `kvrelay up` is in test_launcher.py's real-stack test, which shares its stack start.)"""

from __future__ import annotations

import os
import signal

import httpx
from conftest import ServerProcess
from test_launcher import _fake_up


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
