"""The short fault campaign (benchmarks/fault_campaign.py) on a real `kvrelay up` stack: corrupted
transfers and client disconnects mid-stream under concurrent load. Every answer is token-equal to a
single server or fails with a named cause; nothing hangs; each server holds nothing once idle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "fault_campaign.py"


def test_short_fault_campaign_no_silent_failure_nothing_held(tmp_path):
    out = tmp_path / "campaign.json"
    argv = [sys.executable, str(SCRIPT), "--phases", "corrupt,disconnect", "--kill-kinds", ""]
    argv += ["--faults-per-kind", "12", "--phase-s", "60", "--concurrency", "4"]
    argv += ["--max-tokens", "6", "--log-dir", str(tmp_path / "logs"), "--out", str(out)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(out.read_text())
    assert p.returncode == result["exit_code"] == 0, (result["verdict"], p.stderr[-3000:])
    corrupt, disconnect = result["kinds"]
    assert (corrupt["phase"], disconnect["phase"]) == ("corrupt", "disconnect")
    assert corrupt["faults"]["corrupt"] >= 12 and disconnect["faults"]["disconnect"] >= 12
    # Decode detected every damaged piece (a retried attempt counts); the router saw the cuts.
    assert corrupt["router"]["checksum_mismatch"] == corrupt["faults"]["corrupt"]
    assert disconnect["router"].get("client_disconnects", 0) >= 1, disconnect["router"]
    # The undamaged requests came back, token-equal to the single server.
    assert corrupt["correct"] > 0, corrupt
    assert set(corrupt["causes"]) == {"checksum_mismatch"}, corrupt["causes"]
    for phase in (corrupt, disconnect):
        assert phase["silent"] == phase["hang"] == phase["failed_unnamed"] == 0, phase
        assert phase["held_when_idle"] == {}, phase
        assert phase["requests"] == phase["correct"] + phase["failed_named"] + phase["cut"]
    assert result["totals"]["silent"] == result["totals"]["hang"] == 0
