"""Supervision and health truth with real processes: /health turns 503 when engine steps keep
failing; `kvrelay up` restarts a server whose engine was SIGKILLed (the stack serves again) and
gives up, exit 1, on a child that keeps dying."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest
from conftest import ServerProcess
from test_launcher import _chat, _fake_up, _up

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


def test_up_restarts_a_server_whose_engine_was_killed(tmp_path):
    up = _up(
        tmp_path, "--model", "smollm2", "--max-total-tokens", "8192", "--health-timeout", "400"
    )
    try:
        url = up.wait_for(r"kvrelay up ready: (http://\S+) ", 450)[1]
        assert _chat(url)
        server, decode_url = up.pid_of("decode"), up.url_of("decode")
        killed_at = time.time()
        os.kill(engine_pid(server), signal.SIGKILL)

        # The decode server's HTTP process lives on, but says it cannot serve, and why.
        deadline, h = time.time() + 4, None
        while time.time() < deadline:
            h = httpx.get(decode_url + "/health", timeout=2)
            if h.status_code == 503:
                break
            time.sleep(0.1)
        assert h is not None and h.status_code == 503, h.text if h else None
        assert "engine process died" in h.json()["error"]["message"]

        up.wait_for(
            r"child=decode unhealthy_s=\S+ cause=.*engine process died.* action=restart", 20
        )
        up.wait_for(r"child=decode healthy pid=\d+ restarts=1", 400)
        assert up.pid_of("decode") != server
        deadline, last = time.time() + 120, None
        while time.time() < deadline:
            try:
                assert _chat(url)
                break
            except openai.APIError as e:
                last = e
                time.sleep(1)
        else:
            pytest.fail(f"no successful request after the restart: {last}")
        # kill -> serving again, bounded (generous: CPU test machines are shared and slow to load)
        assert time.time() - killed_at < 600
    finally:
        if up.proc.poll() is None:
            up.proc.send_signal(signal.SIGINT)
            try:
                up.proc.wait(timeout=60)
            except Exception:
                up.proc.kill()


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
