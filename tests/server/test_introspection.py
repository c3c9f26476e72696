"""The introspection routes benchmarks and the ledger use: /server_info, /telemetry/steps and
/telemetry/profile (switching the per-component step split at run time)."""

from __future__ import annotations

import httpx
import pytest

from kvrelay.engine.messages import EngineStats, StepOutputs
from kvrelay.server.telemetry import StepTelemetry


def _step(batch: int, tokens: int, ms: float, prefill: int = 0) -> StepOutputs:
    return StepOutputs([], EngineStats(batch, 0, 0, 1, 0, ms, batch, tokens, prefill))


def test_ring_numbers_steps_and_reports_what_fell_off():
    t = StepTelemetry(capacity=3)
    t.on_step(_step(0, 0, 9.0))  # idle: not a step
    for i in range(5):
        t.on_step(_step(i + 1, i + 1, float(i)))
    got = t.since(0)
    assert [s["seq"] for s in got["steps"]] == [2, 3, 4]
    assert got["dropped"] == 2 and got["next"] == 5 and got["head"] == 5
    assert got["steps"][0] | {"time": 0} == {
        "seq": 2,
        "time": 0,
        "batch_size": 3,
        "num_tokens": 3,
        "step_ms": 2.0,
        "num_prefill": 0,
    }
    assert t.since(5) == {"next": 5, "head": 5, "dropped": 0, "steps": []}
    assert [s["seq"] for s in t.since(3, limit=1)["steps"]] == [3]


def test_server_info_and_step_telemetry(server):
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    assert info["model"] == "smollm2" and info["gpu"] == "cpu"
    assert info["config"]["engine"]["scheduler"]["max_num_batched_tokens"] == 128
    assert info["engine"]["device"] == "cpu" and info["engine"]["page_size"] > 0
    assert info["versions"]["torch"] and info["versions"]["transformers"]
    assert "KVRELAY_CPU_THREADS" in info["env"] and "KVRELAY_LEDGER" in info["env"]
    assert info["git"] is None or len(info["git"]["commit"]) == 40

    head = httpx.get(server.url + "/telemetry/steps?limit=0", timeout=10).json()["head"]
    body = {"model": "smollm2", "prompt": "Hello there", "max_tokens": 4, "ignore_eos": True}
    httpx.post(server.url + "/v1/completions", json=body, timeout=60).raise_for_status()
    got = httpx.get(server.url + f"/telemetry/steps?since={head}", timeout=10).json()
    steps = got["steps"]
    # Alone on the server: one prefill step, then three decode steps of batch 1.
    assert [s["num_prefill"] for s in steps] == [1, 0, 0, 0]
    assert [s["batch_size"] for s in steps] == [1, 1, 1, 1]
    assert steps[0]["num_tokens"] > 1 and [s["num_tokens"] for s in steps[1:]] == [1, 1, 1]
    assert all(s["step_ms"] > 0 for s in steps) and got["next"] == head + 4
    r = httpx.get(server.url + "/telemetry/steps?since=-1", timeout=10)
    assert r.status_code == 400


def _metric_count(url: str, component: str) -> float:
    want = f'kvrelay_engine_step_component_seconds_count{{component="{component}"}} '
    text = httpx.get(url + "/metrics", timeout=10).text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(want)), 0)


def test_step_profile_switched_at_run_time(server):
    url = server.url + "/telemetry/profile"
    assert httpx.get(url, timeout=10).json() == {"every": 0}
    for bad in ({"every": -1}, {"every": "2"}, {"every": True}, {"often": 2}, [2]):
        r = httpx.post(url, json=bad, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["message"], bad
    assert httpx.post(url, content=b"{", timeout=10).status_code == 400
    before = _metric_count(server.url, "attention")
    try:
        assert httpx.post(url, json={"every": 1}, timeout=10).json() == {"every": 1, "previous": 0}
        head = httpx.get(server.url + "/telemetry/steps?limit=0", timeout=10).json()["head"]
        body = {"model": "smollm2", "prompt": "Hello there", "max_tokens": 4, "ignore_eos": True}
        httpx.post(server.url + "/v1/completions", json=body, timeout=60).raise_for_status()
        steps = httpx.get(server.url + f"/telemetry/steps?since={head}", timeout=10).json()["steps"]
    finally:
        assert httpx.post(url, json={"every": 0}, timeout=10).json()["previous"] == 1
    assert len(steps) == 4
    for s in steps:
        c = s["components"]
        assert set(c) == {"attention", "mlp", "communication", "other"}
        assert c["attention"] > 0 and c["mlp"] > 0
        assert sum(c.values()) == pytest.approx(s["step_ms"], rel=1e-6)
    assert _metric_count(server.url, "attention") == before + 4
