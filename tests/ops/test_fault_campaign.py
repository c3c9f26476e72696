"""The short fault campaign (benchmarks/fault_campaign.py) on real `kvrelay up` stacks: corrupted
transfers and client disconnects mid-stream under concurrent load, then overload (8x the router's
--max-concurrent-requests, servers running fewer than it), then strangers (a flood of idle and
garbage connections to the transfer port, slowloris, ambiguous bodies, replayed PD signatures). Every answer is token-equal to a
single server or fails with a named cause (past the router's limit: a 503/429 with Retry-After);
nothing hangs; each server holds nothing once idle. (slow_peer runs in the full campaign only:
another stack, ~25 s more here.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "fault_campaign.py"


def test_short_fault_campaign_no_silent_failure_nothing_held(tmp_path):
    out = tmp_path / "campaign.json"
    argv = [sys.executable, str(SCRIPT), "--phases", "corrupt,disconnect,overload,stranger"]
    argv += ["--flood-rounds", "1", "--slowloris-per-target", "30", "--stranger-requests", "5"]
    argv += ["--kill-kinds", "", "--faults-per-kind", "12", "--phase-s", "60", "--concurrency", "4"]
    argv += ["--overload-s", "4", "--overload-concurrency", "16", "--overload-limit", "2"]
    argv += ["--overload-server-args=--max-running-requests 1"]
    argv += ["--max-tokens", "6", "--log-dir", str(tmp_path / "logs"), "--out", str(out)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(out.read_text())
    assert p.returncode == result["exit_code"] == 0, (result["verdict"], p.stderr[-3000:])
    assert result["skipped"] == [] and result["problems"] == []
    corrupt, disconnect, overload, stranger = result["kinds"]
    assert (corrupt["phase"], disconnect["phase"]) == ("corrupt", "disconnect")
    assert corrupt["faults"]["corrupt"] >= 12 and disconnect["faults"]["disconnect"] >= 12
    # Decode detected every damaged piece (a retried attempt counts); the router saw the cuts.
    assert corrupt["router"]["checksum_mismatch"] == corrupt["faults"]["corrupt"]
    assert disconnect["router"].get("client_disconnects", 0) >= 1, disconnect["router"]
    # The undamaged requests came back, token-equal to the single server.
    assert corrupt["correct"] > 0, corrupt
    assert set(corrupt["causes"]) == {"checksum_mismatch"}, corrupt["causes"]
    # Overload: past the limit a clear 503/429 with Retry-After, the rest token-equal to the single
    # server; the router never held more than its limit, and holds nothing once idle.
    assert overload["rejected"] > 0 and overload["rejected_unclear"] == 0, overload
    assert set(overload["rejection_status"]) <= {"429", "503"}, overload["rejection_status"]
    assert "None" not in overload["retry_after"], overload["retry_after"]
    assert overload["admitted"] == overload["correct"] > 0, overload["admitted_not_correct"]
    assert overload["router_inflight_peak"] <= 2 and overload["router_inflight_idle"] == 0
    assert overload["restarts"] == 0, overload["launcher_events"]
    # Strangers (fault_strangers.py): each flood connection refused and counted by decode, no
    # slowloris connection left open, replays and stale signatures 403 and counted.
    assert stranger["phase"] == "stranger" and stranger["problems"] == [], stranger["problems"]
    assert stranger["flood_counted_by_decode"] == stranger["faults"]["transfer_flood"] > 0
    assert stranger["slowloris_held_past_deadline"] == 0
    assert stranger["replay_status"]["replay"] == {"403": 5}, stranger["replay_status"]
    assert stranger["correct"] == stranger["requests"] > 0, stranger
    for phase in (corrupt, disconnect, overload, stranger):
        assert phase["silent"] == phase["hang"] == phase["failed_unnamed"] == 0, phase
        assert phase["held_when_idle"] == {}, phase
        assert phase["requests"] == phase["correct"] + phase["failed_named"] + phase["cut"]
    assert result["totals"]["silent"] == result["totals"]["hang"] == 0
