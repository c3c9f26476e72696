"""`kvrelay up` with real processes: ready line, a request through the router, a SIGKILLed decode
server and then a SIGKILLed decode engine restarted by the supervisor (requests succeed again), and
a clean Ctrl-C with no child left.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvrelay.ops.launcher import LaunchConfig, build_specs
from kvrelay.ops.procs import engine_pid

UP = "import sys; from kvrelay.ops.cli import main; sys.exit(main(sys.argv[1:]))"


def _descendants(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.add(k)
            todo.append(k)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Up:
    """`kvrelay up` as a subprocess whose output lines are collected by a reader thread."""

    def __init__(self, argv: list[str]) -> None:
        env = dict(os.environ, KVRELAY_CPU_THREADS="1")
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self._q.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self._q.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no line matching {pattern!r}; output:\n{''.join(self.lines)}")

    def pid_of(self, name: str) -> int:
        pids = [int(m[1]) for ln in self.lines if (m := re.search(rf"child={name} pid=(\d+)", ln))]
        return pids[-1]

    def url_of(self, name: str) -> str:
        return [m[1] for ln in self.lines if (m := re.search(rf"child={name} .*url=(\S+)", ln))][-1]

    def stop(self) -> None:
        """Ctrl-C if it still runs (a test that failed midway); killed past 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _left_alive(pids: set[int], timeout: float) -> list[int]:
    """Those of `pids` still alive after up to `timeout` seconds."""
    deadline = time.time() + timeout
    while (left := [p for p in pids if _alive(p)]) and time.time() < deadline:
        time.sleep(0.2)
    return left


def _up(log_dir: Path, *args: str) -> Up:
    return Up([sys.executable, "-c", UP, "up", "--port", "0", "--log-dir", str(log_dir), *args])


def _chat(url: str, key: str = "unused") -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    r = c.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].finish_reason in ("length", "stop")
    return r.choices[0].message.content or ""


def test_build_specs_ports_gpus_and_logs(tmp_path):
    cfg = LaunchConfig(
        port=0,
        transfer_port=45678,
        log_dir=str(tmp_path),
        prefill_gpus="0-3",
        decode_gpus="4,5",
        server_args=("--model", "smollm2"),
        api_key="stack-key",
        pd_secret="stack-secret",
    )
    p, d, r = build_specs(cfg)
    assert (p.name, d.name, r.name) == ("prefill", "decode", "router")
    assert p.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and d.env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert d.argv[d.argv.index("--transfer-port") + 1] == "45678"
    assert "--transfer-port" not in p.argv and p.argv[-4:-2] == ["--model", "smollm2"]
    # Each side's GPUs are its tensor-parallel ranks, so the two sizes may differ.
    assert p.argv[-2:] == ["--tensor-parallel-size", "4"]
    assert d.argv[-2:] == ["--tensor-parallel-size", "2"]
    one = build_specs(
        dataclasses.replace(cfg, decode_gpus="7", prefill_args=("--tensor-parallel-size", "1"))
    )
    assert one[0].argv.count("--tensor-parallel-size") == 1 and one[0].argv[-1] == "1"
    assert "--tensor-parallel-size" not in one[1].argv  # one GPU: no TP
    assert "--tensor-parallel-size" not in build_specs(LaunchConfig(log_dir=str(tmp_path)))[0].argv
    assert r.argv[r.argv.index("--prefill") + 1] == p.url
    assert r.argv[r.argv.index("--decode") + 1] == d.url
    assert {s.log_path.name for s in (p, d, r)} == {"prefill.log", "decode.log", "router.log"}
    # The secrets reach every child through its environment, never its (world-readable) argv.
    for s in (p, d, r):
        assert s.env["KVRELAY_PD_SECRET"] == "stack-secret"
        assert s.env["KVRELAY_API_KEY"] == "stack-key"
        assert not any("stack-" in arg for arg in s.argv)


def test_up_serves_restarts_decode_and_stops_cleanly(tmp_path):
    """One real stack (its start loads the model in two servers, slow on CPU): a request through
    it, the decode server SIGKILLed and restarted, then decode's engine alone SIGKILLed (its HTTP
    process says why it cannot serve, the supervisor restarts it), then a clean Ctrl-C."""
    key = "up-test-key"  # `kvrelay up --api-key`: the router asks clients, the servers the router
    up = _up(
        tmp_path,
        *("--model", "smollm2", "--max-total-tokens", "8192", "--health-timeout", "400"),
        *("--api-key", key),
    )
    try:
        url = up.wait_for(r"kvrelay up ready: (http://\S+) .*\| try: curl ", 450)[1]
        assert _chat(url, key)  # PD through the stack's generated secret, the key on each hop
        with pytest.raises(openai.AuthenticationError):
            _chat(url)
        with pytest.raises(openai.AuthenticationError):  # the servers want it too
            _chat(up.url_of("decode"))
        for name in ("prefill", "decode", "router"):
            assert (tmp_path / f"{name}.log").stat().st_size > 0

        # The decode server's process dies (its engine with it): restarted, serving again.
        decode = up.pid_of("decode")
        os.kill(decode, signal.SIGKILL)
        up.wait_for(r"child=decode exited rc=-9 .* restarts=1", 15)
        up.wait_for(r"child=decode pid=\d+ .*restarts=1", 15)
        assert up.pid_of("decode") != decode
        up.wait_for(r"child=decode healthy pid=\d+ restarts=1", 400)
        _serves_again(url, key, 120)

        # Decode's engine alone dies: the HTTP process says it cannot serve, and why, then exits
        # non-zero; the supervisor restarts the server, and the stack serves again, in bounded time.
        server, decode_url = up.pid_of("decode"), up.url_of("decode")
        killed_at = time.time()
        os.kill(engine_pid(server), signal.SIGKILL)
        deadline, h = time.time() + 4, None
        while time.time() < deadline:
            h = httpx.get(decode_url + "/health", timeout=2)
            if h.status_code == 503:
                break
            time.sleep(0.1)
        assert h is not None and h.status_code == 503, h.text if h else None
        assert "engine process died" in h.json()["error"]["message"]
        # The server exits 3 (KVRELAY_ENGINE_DEATH_EXIT_S after the death), before the
        # supervisor's own unhealthy deadline (KVRELAY_UP_UNHEALTHY_S) would restart it.
        up.wait_for(r"child=decode exited rc=3 .*action=restart", 20)
        up.wait_for(r"child=decode healthy pid=\d+ restarts=2", 400)
        assert up.pid_of("decode") != server
        _serves_again(url, key, 120)
        # kill -> serving again, bounded (generous: CPU test machines are shared and slow to load)
        assert time.time() - killed_at < 600

        children = _descendants(up.proc.pid)
        assert children
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=60) == 0, "".join(up.lines)
        left = _left_alive(children, 5)
        assert not left, f"children still alive: {left}"
        assert any("shutdown done" in ln for ln in up.lines)
    finally:
        up.stop()


def _serves_again(url: str, key: str, timeout: float) -> None:
    deadline, last = time.time() + timeout, None
    while time.time() < deadline:
        try:
            assert _chat(url, key)
            return
        except openai.APIError as e:
            last = e
            time.sleep(0.25)
    pytest.fail(f"no successful request after the restart: {last}")


def _fake_up(log_dir: Path) -> Up:
    return Up([sys.executable, str(Path(__file__).with_name("fake_stack.py")), str(log_dir)])


def test_sighup_co_restarts_all_and_crashes_are_restarted(tmp_path):
    up = _fake_up(tmp_path)
    try:
        up.wait_for(r"kvrelay up ready: http://\S+ \(model fake\)", 30)
        first = {n: up.pid_of(n) for n in ("prefill", "decode", "router")}

        os.kill(first["router"], signal.SIGKILL)
        up.wait_for(r"child=router exited rc=-9 .*restarts=1", 10)
        up.wait_for(r"child=router healthy pid=\d+ restarts=1", 10)

        up.proc.send_signal(signal.SIGHUP)
        up.wait_for(r"co-restart begin", 10)
        up.wait_for(r"kvrelay up ready: ", 30)
        second = {n: up.pid_of(n) for n in ("prefill", "decode", "router")}
        assert all(second[n] != first[n] for n in first)
        assert not any(_alive(p) for p in first.values())

        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=30) == 0
        assert not any(_alive(p) for p in second.values())
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


def test_a_child_that_dies_at_startup_fails_the_launch(tmp_path):
    up = _up(tmp_path, "--model", "/nonexistent/model.gguf", "--health-timeout", "60")
    try:
        assert up.proc.wait(timeout=90) == 1
        assert any("startup failed" in ln for ln in up.lines), "".join(up.lines)
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


def test_children_die_with_a_killed_launcher(tmp_path):
    up = _fake_up(tmp_path)
    try:
        up.wait_for(r"kvrelay up ready: ", 30)
        pids = [up.pid_of(n) for n in ("prefill", "decode", "router")]
        up.proc.kill()
        up.proc.wait()
        deadline = time.time() + 10
        while any(_alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
