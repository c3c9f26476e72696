"""The router's /health and /ready never wait on a frozen server (one that accepts connections
and never answers, as a SIGSTOPped process does): they answer from the background probe's last
view at once, /ready naming the server that does not answer. (The audit saw /health block 12-20 s;
router_probe.py already held; this pins it with a real router process.)"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
from conftest import free_port


def test_router_health_answers_at_once_while_its_servers_are_frozen():
    frozen = [socket.create_server(("127.0.0.1", 0), backlog=64) for _ in range(2)]
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in frozen]
    port = free_port()
    argv = [sys.executable, "-m", "kvrelay.cli", "router", "--port", str(port)]
    argv += ["--prefill", urls[0], "--decode", urls[1], "--pd-secret", "frozen-test"]
    router = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None and time.monotonic() < deadline
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        slowest, ready = 0.0, None
        with httpx.Client(timeout=5) as http:
            end = time.monotonic() + 4  # past two probe timeouts (2 s each)
            while time.monotonic() < end:
                t0 = time.monotonic()
                health = http.get(url + "/health")
                ready = http.get(url + "/ready")
                slowest = max(slowest, time.monotonic() - t0)
                assert health.status_code == 200 and ready.status_code == 503
                time.sleep(0.1)
        assert slowest < 1.0, slowest  # two answers; a frozen probe takes 2 s to time out
        assert "no answer" in ready.text or "not probed yet" in ready.text, ready.text
    finally:
        router.terminate()
        router.wait(timeout=20)
        for s in frozen:
            s.close()
