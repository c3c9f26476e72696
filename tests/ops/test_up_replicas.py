"""`kvrelay up --prefill-replicas N --decode-replicas M`: how replicas share GPUs and ports (the
rule and its refusals); supervision of 2 x 2 tiny children (a replica restarted alone, SIGHUP
co-restarts all five); and one real 2 x 2 stack (SmolLM2 on the CPU): requests through the
router reach every replica, a SIGKILLed decode replica is restarted alone on its port while
requests keep succeeding through the other one, the router sends to it again once it is back,
one log file per replica, and Ctrl-C stops all five processes."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from test_launcher import Up, _alive, _descendants, _left_alive, _up

from kvrelay.ops.cli import main as up_main
from kvrelay.ops.replicas import gpu_groups
from kvrelay.ops.stack import LaunchConfig, build_specs


def test_gpus_split_among_replicas_or_refused():
    assert gpu_groups(None, 3, "decode") == [None, None, None]
    assert gpu_groups("0,1", 2, "prefill") == ["0", "1"]
    assert gpu_groups("0-3", 2, "prefill") == ["0,1", "2,3"]  # in order, equal groups
    assert gpu_groups("4-7", 1, "decode") == ["4,5,6,7"]  # one replica: as before
    assert gpu_groups("0,1/2", 2, "prefill") == ["0,1", "2"]  # explicit groups may differ
    assert gpu_groups("0/0", 2, "decode") == ["0", "0"]  # and share a GPU, when said so
    assert gpu_groups("GPU-a1b2,GPU-c3d4", 2, "decode") == ["GPU-a1b2", "GPU-c3d4"]
    for spec, n, why in (
        ("0,1,2", 2, "3 GPU(s) for 2 prefill replicas, which do not split evenly"),
        ("0", 2, "1 GPU(s) for 2 prefill replicas"),
        ("0/1/2", 2, "names 3 GPU groups for 2 prefill replica(s)"),
        ("0,1/2", 1, "names 2 GPU groups for 1 prefill replica(s)"),
        ("0,0", 2, "GPU 0 is named twice in the list"),
        ("0,1,1/2", 2, "GPU 1 is named twice in one replica's group"),
        ("0/", 2, "an empty GPU group"),
        ("3-1", 1, "the range '3-1' is empty"),
        ("0", 0, "--prefill-replicas must be at least 1"),
    ):
        with pytest.raises(ValueError, match="--prefill-") as e:
            gpu_groups(spec, n, "prefill")
        assert why in str(e.value), (spec, n, str(e.value))


def test_specs_of_two_by_two(tmp_path):
    cfg = LaunchConfig(
        port=8000,
        prefill_port=8100,
        decode_port=8200,
        transfer_port=9200,
        prefill_replicas=2,
        decode_replicas=2,
        prefill_gpus="0,1",
        decode_gpus="2-5",
        log_dir=str(tmp_path),
        pd_secret="s",
    )
    *servers, router = build_specs(cfg)
    by = {s.name: s for s in servers}
    assert list(by) == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    assert [s.role for s in servers] == ["prefill", "prefill", "decode", "decode"]
    assert [s.url.rsplit(":", 1)[1] for s in servers] == ["8100", "8101", "8200", "8201"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in servers] == ["0", "1", "2,3", "4,5"]
    assert "--tensor-parallel-size" not in by["prefill-1"].argv  # one GPU each
    assert by["decode-1"].argv[-2:] == ["--tensor-parallel-size", "2"]
    for name, tport in (("decode-0", "9200"), ("decode-1", "9201")):
        argv = by[name].argv
        assert argv[argv.index("--transfer-port") + 1] == tport
    assert [s.log_path.name for s in (*servers, router)] == [
        "prefill-0.log",
        "prefill-1.log",
        "decode-0.log",
        "decode-1.log",
        "router.log",
    ]
    ra = router.argv
    assert ra[ra.index("--prefill") + 1] == f"{by['prefill-0'].url},{by['prefill-1'].url}"
    assert ra[ra.index("--decode") + 1] == f"{by['decode-0'].url},{by['decode-1'].url}"
    # Free ports (0) are distinct across every child and listener of the stack.
    free = build_specs(LaunchConfig(port=0, prefill_replicas=3, decode_replicas=3))
    ports = [int(s.url.rsplit(":", 1)[1]) for s in free]
    ports += [int(s.argv[s.argv.index("--transfer-port") + 1]) for s in free if s.role == "decode"]
    assert len(ports) == len(set(ports)) == 10
    # Replica ports count up from the base: prefill-1 on 8002 would be decode's.
    with pytest.raises(ValueError, match="port 8002 is given to both prefill-1 and decode"):
        build_specs(
            LaunchConfig(port=8000, prefill_port=8001, decode_port=8002, prefill_replicas=2)
        )


def test_up_refuses_an_uneven_gpu_split(capsys):
    assert up_main(["up", "--prefill-replicas", "2", "--prefill-gpus", "0-2"]) == 2
    err = capsys.readouterr().err
    assert "kvrelay up: error: --prefill-gpus '0-2' has 3 GPU(s) for 2 prefill replicas" in err


# fake_stack.py's tiny HTTP children (no model) behind a Launcher of 2 prefill x 2 decode replicas.
FAKE_2X2 = f"""
import dataclasses, logging, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from fake_stack import CHILD
from kvrelay.ops.launcher import LaunchConfig, Launcher
logging.basicConfig(level="INFO", format="%(levelname)s %(name)s %(message)s")
logging.getLogger("httpx").setLevel(logging.WARNING)
cfg = LaunchConfig(
    port=0, log_dir=sys.argv[1], health_timeout_s=20, prefill_replicas=2, decode_replicas=2
)
ready = lambda url, model: print(f"kvrelay up ready: {{url}} (model {{model}})", flush=True)
launcher = Launcher(cfg, on_ready=ready, poll_s=0.05)
for c in launcher.children:
    port = c.spec.url.rsplit(":", 1)[1]
    c.spec = dataclasses.replace(c.spec, argv=[sys.executable, "-c", CHILD, port])
sys.exit(launcher.run())
"""
NAMES = ("prefill-0", "prefill-1", "decode-0", "decode-1", "router")


def test_replicas_restart_alone_and_sighup_co_restarts_all(tmp_path):
    up = Up([sys.executable, "-c", FAKE_2X2, str(tmp_path)])
    try:
        up.wait_for(r"kvrelay up ready: http://\S+ \(model fake\)", 30)
        first = {n: up.pid_of(n) for n in NAMES}
        assert len(set(first.values())) == 5
        os.kill(first["prefill-1"], signal.SIGKILL)
        up.wait_for(r"child=prefill-1 exited rc=-9 .*action=restart .*restarts=1", 10)
        up.wait_for(r"child=prefill-1 healthy pid=\d+ restarts=1", 15)
        again = {n: up.pid_of(n) for n in NAMES}
        assert again["prefill-1"] != first["prefill-1"]
        assert all(again[n] == first[n] for n in NAMES if n != "prefill-1"), (first, again)

        up.proc.send_signal(signal.SIGHUP)
        up.wait_for(r"co-restart begin", 10)
        up.wait_for(r"kvrelay up ready: ", 30)
        second = {n: up.pid_of(n) for n in NAMES}
        assert all(second[n] != again[n] for n in NAMES), (again, second)
        assert not any(_alive(p) for p in again.values())

        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=30) == 0
        assert not any(_alive(p) for p in second.values())
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.log" for n in NAMES)
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


def _sum(url: str, prefix: str, having: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(prefix) and having in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _requests(url: str) -> float:
    return _sum(url, "kvrelay_requests_total{")


def _chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smollm2",
        # A fresh start: no cached prefix anywhere, so cache_aware routing takes idle servers in turn.
        messages=[{"role": "user", "content": f"{uuid.uuid4().hex} Name a colour."}],
        max_tokens=4,
        temperature=0,
    )
    assert r.choices[0].finish_reason in ("length", "stop")


def test_two_by_two_stack_serves_and_restarts_one_decode_alone(tmp_path):
    up = _up(
        tmp_path,
        *("--prefill-replicas", "2", "--decode-replicas", "2"),
        *("--model", "smollm2", "--max-total-tokens", "4096", "--health-timeout", "400"),
    )
    names = ("prefill-0", "prefill-1", "decode-0", "decode-1")
    try:
        url = up.wait_for(r"kvrelay up ready: (http://\S+) ", 450)[1]
        urls = {n: up.url_of(n) for n in names}
        assert len(set(urls.values())) == 4
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        for _ in range(4):
            _chat(client)
        for n in names:  # every replica took part: each prefill sent KV, each decode answered
            assert _requests(urls[n]) >= 1, n
        for n in ("prefill-0", "prefill-1"):
            assert _sum(urls[n], "kvrelay_pd_transfer_bytes_total{", 'direction="sent"') > 0, n
        logs = sorted(p.name for p in tmp_path.iterdir())
        assert logs == sorted(f"{n}.log" for n in (*names, "router"))
        for n in names:  # each replica's own log: its ready line names its own port
            assert f"kvrelay ready: {urls[n]} " in (tmp_path / f"{n}.log").read_text(), n

        # decode-1 dies: it alone is restarted on its ports; requests keep succeeding meanwhile.
        before = {n: up.pid_of(n) for n in (*names, "router")}
        served0 = _requests(urls["decode-0"])
        os.kill(before["decode-1"], signal.SIGKILL)
        up.wait_for(r"child=decode-1 exited rc=-9 .*action=restart", 30)
        during = 0
        deadline = time.time() + 400
        while not any("child=decode-1 healthy" in ln for ln in up.lines):
            assert time.time() < deadline, "decode-1 was not healthy again in time"
            _chat(client)  # raises on any failure
            during += 1
        assert during >= 1

        # Each was answered by decode-0 (its counter read as a delta) or, once back, by the new
        # decode-1 (its counter starts at 0): the router's probe may take decode-1 back before
        # the supervisor's log line says it is healthy, and the last requests may go there.
        def answered() -> float:
            return _requests(urls["decode-0"]) - served0 + _requests(urls["decode-1"])

        deadline = time.time() + 10
        while answered() < during and time.time() < deadline:
            time.sleep(0.2)
        assert answered() >= during
        after = {n: up.pid_of(n) for n in before}
        assert after["decode-1"] != before["decode-1"]
        assert all(after[n] == before[n] for n in before if n != "decode-1"), (before, after)
        assert not [ln for ln in up.lines if "exited rc" in ln and "decode-1" not in ln]
        assert up.url_of("decode-1") == urls["decode-1"]  # its same port
        log = (tmp_path / "decode-1.log").read_text()
        assert log.count("--- kvrelay up: starting decode-1") == 2
        assert (tmp_path / "decode-0.log").read_text().count("--- kvrelay up: starting") == 1

        # The router's probe takes the restarted replica back into the rotation.
        deadline = time.time() + 60
        while _requests(urls["decode-1"]) < 1:
            assert time.time() < deadline, "no request reached the restarted decode-1"
            _chat(client)

        children = _descendants(up.proc.pid)
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=60) == 0, "".join(up.lines)
        left = _left_alive(children, 10)
        assert not left, f"children still alive: {left}"
    finally:
        up.stop()
