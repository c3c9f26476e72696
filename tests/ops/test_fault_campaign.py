"""The short fault campaign (benchmarks/fault_campaign.py) on a real `kvrelay up` stack: decode
goes silent, then decode's engine is SIGKILLed, under load. Every request ends (none hangs), the
stack recovers from both, and the launcher's restart of decode is in the report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "fault_campaign.py"


def test_short_fault_campaign_recovers_and_nothing_hangs(tmp_path):
    out = tmp_path / "campaign.json"
    argv = [sys.executable, str(SCRIPT), "--faults", "silent_decode,kill_decode_engine"]
    argv += ["--concurrency", "2", "--max-tokens", "4", "--silent-s", "4", "--settle-s", "2"]
    argv += ["--log-dir", str(tmp_path / "logs"), "--out", str(out)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(out.read_text())
    assert p.returncode == result["exit_code"] == 0, (result["verdict"], p.stderr[-3000:])
    silent, killed = result["faults"]
    assert (silent["fault"], killed["fault"]) == ("silent_decode", "kill_decode_engine")
    for f in (silent, killed):
        assert f["hanging"] == 0 and f["recovered"] and f["requests"] > 0, f
        assert f["ok"] + f["failed"] == f["requests"]
    # The engine's death made decode unhealthy; the launcher restarted it, and it came back.
    events = " | ".join(killed["launcher_events"])
    assert "child=decode unhealthy_s=" in events and "engine process died" in events, events
    assert "child=decode healthy" in events, events
    assert result["hanging"] == 0
