"""The run ledger: what a run stores, concurrent writers, a run killed mid-write, and the report."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
from dataclasses import asdict

import pytest

from kvrelay.config import ServerConfig
from kvrelay.ledger import configs, store
from kvrelay.ledger.cli import add_report_parser
from kvrelay.ledger.record import record_run
from kvrelay.ledger.report import render


def server_info(port: int = 8000, **scheduler) -> dict:
    cfg = asdict(ServerConfig(port=port))
    cfg["engine"]["scheduler"] |= scheduler
    return {"model": "smollm2", "config": cfg, "gpu": "cpu", "engine": {"dtype": "float32"}}


def rows(path) -> list[sqlite3.Row]:
    conn = store.connect(path, create=False)
    try:
        return conn.execute("SELECT * FROM runs ORDER BY id").fetchall()
    finally:
        conn.close()


def report(args: list[str]) -> int:
    p = argparse.ArgumentParser()
    add_report_parser(p.add_subparsers(dest="command", required=True))
    a = p.parse_args(["report", *args])
    return a.func(a)


def test_path_flag_then_env_then_default(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRELAY_LEDGER", str(tmp_path / "env.db"))
    assert store.resolve_path(str(tmp_path / "flag.db")) == tmp_path / "flag.db"
    assert store.resolve_path(None) == tmp_path / "env.db"
    monkeypatch.setenv("KVRELAY_LEDGER", "off")
    assert store.resolve_path(None) is None
    assert record_run(None, "bench", {}, {}) is None  # off: nothing recorded, nothing raised
    monkeypatch.delenv("KVRELAY_LEDGER")
    assert store.resolve_path(None) == store.Path.home() / ".kvrelay" / "ledger.db"


def test_run_stores_config_environment_and_results(tmp_path):
    path = tmp_path / "l.db"
    results = {"levels": [{"output_throughput": 12.5}], "nested": {"x": [1, 2]}}
    info = server_info(max_num_batched_tokens=128)
    run_id = record_run(
        path, "bench", {"seed": 1}, results, server_info=info, workload="w", headline="h"
    )
    (r,) = rows(path)
    assert r["id"] == run_id and (r["kind"], r["status"], r["workload"]) == ("bench", "ok", "w")
    assert json.loads(r["results"]) == results and json.loads(r["config"]) == {"seed": 1}
    assert json.loads(r["server_info"]) == info and r["gpu"] == "cpu"
    client = json.loads(r["client"])
    assert client["versions"]["kvrelay"] and "KVRELAY_LEDGER" in client["env"]
    assert r["git_commit"] is None or len(r["git_commit"].removesuffix("-dirty")) == 40
    assert r["config_label"] == "smollm2 · cpu float32 · max_num_batched_tokens=128"
    # The same settings on another port are the same configuration; other settings are not.
    assert r["config_key"] == configs.config_key(server_info(9000, max_num_batched_tokens=128))
    assert r["config_key"] != configs.config_key(server_info())
    assert configs.config_diff(server_info(), info) == "max_num_batched_tokens: 2048 -> 128"
    # The server's environment knobs are part of its configuration (but not where it records).
    knobs = server_info() | {"env": {"KVRELAY_CPU_THREADS": "2", "KVRELAY_LEDGER": "/a"}}
    assert configs.config_label(knobs) == "smollm2 · cpu float32 · KVRELAY_CPU_THREADS=2"
    assert configs.config_key(knobs) != configs.config_key(server_info())
    moved = knobs | {"env": {"KVRELAY_CPU_THREADS": "2", "KVRELAY_LEDGER": "/b"}}
    assert configs.config_key(knobs) == configs.config_key(moved)


WRITER = """
import sys
from kvrelay.ledger.record import record_run
for i in range(int(sys.argv[3])):
    record_run(sys.argv[1], "bench", {"writer": sys.argv[2], "i": i}, {"x": "y" * 5000},
               server_info={"model": "m", "url": "u"})
"""


def test_concurrent_writers_lose_nothing(tmp_path):
    path, writers, each = tmp_path / "l.db", 4, 10
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(w), str(each)])
        for w in range(writers)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0] * writers
    got = sorted(
        (json.loads(r["config"])["writer"], json.loads(r["config"])["i"]) for r in rows(path)
    )
    assert got == sorted((str(w), i) for w in range(writers) for i in range(each))
    conn = store.connect(path, create=False)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


KILLED = """
import sys, time
from kvrelay.ledger import store
conn = store.connect(store.Path(sys.argv[1]))
conn.execute("BEGIN IMMEDIATE")
run = store.Run("bench", "ok", None, "t", "k", "l", "w", "h", None, None, None, {}, {}, {},
                {"big": "z" * 3_000_000})
store.insert(conn, run, store.Decision("reject", "c", "r", "e"))
print("inserted", flush=True)
time.sleep(60)
"""


def test_run_killed_mid_write_leaves_earlier_records_intact(tmp_path):
    path = tmp_path / "l.db"
    for i in range(3):
        record_run(path, "bench", {"i": i}, {"i": i}, server_info={"model": "m"})
    p = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout.readline().strip() == "inserted"  # inside its open transaction
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    assert [json.loads(r["results"]) for r in rows(path)] == [{"i": 0}, {"i": 1}, {"i": 2}]
    conn = store.connect(path, create=False)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("SELECT count(*) FROM decisions").fetchone()[0] == 0
    conn.close()
    # The dead writer's lock went with it: the next run is recorded.
    assert record_run(path, "bench", {}, {"i": 3}, server_info={"model": "m"}) == 4


def test_report_on_missing_and_empty_ledger(tmp_path, capsys):
    missing = tmp_path / "none.db"
    assert report(["--ledger", str(missing)]) == 0
    assert "The ledger is empty: there is no ledger file" in capsys.readouterr().out
    assert not missing.exists()  # a report creates nothing
    store.connect(tmp_path / "empty.db").close()
    assert report(["--ledger", str(tmp_path / "empty.db")]) == 0
    assert "is empty: no run has been recorded yet" in capsys.readouterr().out
    assert report(["--ledger", "off"]) == 2


def test_report_latest_per_configuration_decisions_and_do_not_retread(tmp_path):
    path = tmp_path / "l.db"
    base, small = server_info(), server_info(max_num_batched_tokens=128)
    record_run(path, "bench", {}, {}, server_info=base, workload="random c=8", headline="old")
    record_run(path, "bench", {}, {}, server_info=base, workload="random c=8", headline="new")
    record_run(path, "verify", {}, {}, server_info=base, workload="verify", headline="identical")
    record_run(path, "bench", {}, {}, server_info=small, workload="random c=8", headline="small")
    evidence = "B is -7.9% ± 1.2% output tok/s at concurrency 64 (worse)"
    record_run(
        path,
        "ab",
        {},
        {},
        server_info=small,
        workload="ab",
        headline=evidence,
        decision=store.Decision(
            "reject", "max_num_batched_tokens: 2048 -> 128", "slower", evidence
        ),
    )
    record_run(
        path, "ab", {}, {}, server_info=base, workload="ab2", headline="no significant difference"
    )
    md = render(path)
    latest = md.split("## Latest results per configuration")[1].split("## A/B decisions")[0]
    assert "| new |" in latest and "| old |" not in latest and "| identical |" in latest
    assert (
        "| small |" in latest and "### smollm2 · cpu float32 · max_num_batched_tokens=128" in latest
    )
    assert latest.index("small") < latest.index("new")  # most recently measured first
    decisions = md.split("## A/B decisions")[1].split("## Do not retread")[0]
    assert "REJECT" in decisions and evidence.replace("|", "\\|") in decisions
    retread = md.split("## Do not retread")[1]
    assert "- **max_num_batched_tokens: 2048 -> 128**: slower (evidence: B is -7.9%" in retread
    assert "no significant difference" in retread.split("without a decision")[1]


def test_report_writes_file(tmp_path, capsys):
    path, out = tmp_path / "l.db", tmp_path / "status.md"
    record_run(path, "bench", {}, {}, server_info={"model": "m", "url": "http://x"}, headline="h")
    assert report(["--ledger", str(path), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# kvrelay status report") and "m at http://x (no /server_info)" in text
    assert "Nothing rejected yet." in text


@pytest.mark.parametrize("bad", ["accept!", "maybe"])
def test_decisions_are_checked(tmp_path, bad):
    with pytest.raises(store.LedgerError):
        record_run(tmp_path / "l.db", "ab", {}, {}, decision=store.Decision(bad, "c", "r", "e"))
