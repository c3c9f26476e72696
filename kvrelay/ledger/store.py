"""The ledger file: SQLite in WAL mode with a busy timeout, so that several runs can write at once.

Each run is written at its end in one transaction (with its A/B decision, if any). A run killed
before that leaves no record, and never a partial one: SQLite's atomic commit guarantees that the
records of earlier runs are untouched.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvrelay.config import env

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 60.0  # a writer waits this long for another's transaction to end
OFF = "off"

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,             -- bench | verify | ab | repro
    status TEXT NOT NULL,           -- ok | errors (some requests failed)
    started_at TEXT,                -- ISO 8601, UTC
    finished_at TEXT NOT NULL,
    config_key TEXT NOT NULL,       -- hash of the server configuration (configs.config_key)
    config_label TEXT NOT NULL,     -- the model, device and settings that differ from defaults
    workload TEXT NOT NULL,         -- what was run, e.g. 'random in=256 out=64 c=1,8'
    headline TEXT NOT NULL,         -- one line of results for the report
    server_url TEXT,
    gpu TEXT,
    git_commit TEXT,                -- the client's checkout
    server_info TEXT NOT NULL,      -- JSON: GET /server_info (or what could be learned)
    client TEXT NOT NULL,           -- JSON: versions, git, env knobs, host, argv
    config TEXT NOT NULL,           -- JSON: the run's own settings
    results TEXT NOT NULL           -- JSON: the full results
);
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    decided_at TEXT NOT NULL,
    decision TEXT NOT NULL CHECK (decision IN ('accept', 'reject')),
    change TEXT NOT NULL,           -- what B changes relative to A
    reason TEXT NOT NULL,
    evidence TEXT NOT NULL          -- the A/B verdict the decision rests on
);
CREATE INDEX IF NOT EXISTS runs_by_config ON runs (config_key, kind, workload, id);
"""


class LedgerError(Exception):
    """The ledger cannot be opened or written."""


@dataclass(frozen=True)
class Run:
    """One row to insert; JSON columns as Python objects."""

    kind: str
    status: str
    started_at: str | None
    finished_at: str
    config_key: str
    config_label: str
    workload: str
    headline: str
    server_url: str | None
    gpu: str | None
    git_commit: str | None
    server_info: dict
    client: dict
    config: dict
    results: dict


@dataclass(frozen=True)
class Decision:
    decision: str  # accept | reject
    change: str
    reason: str
    evidence: str


def resolve_path(flag: str | None) -> Path | None:
    """--ledger, else KVRELAY_LEDGER, else ~/.kvrelay/ledger.db; None when set to 'off'."""
    raw = flag if flag is not None else env("KVRELAY_LEDGER")
    return None if raw.strip().lower() == OFF else Path(raw).expanduser()


def utc_now(t: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if t is None else t))


def connect(path: Path, create: bool = True) -> sqlite3.Connection:
    """An autocommit connection (transactions are explicit) with WAL and a busy timeout."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    elif not path.exists():
        raise LedgerError(f"no ledger at {path}")
    try:
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.row_factory = sqlite3.Row
        if create:
            with transaction(conn):
                _create(conn)
    except sqlite3.Error as e:
        raise LedgerError(f"cannot open the ledger {path}: {e}") from None
    return conn


def _create(conn: sqlite3.Connection) -> None:
    # executescript would commit the open transaction; run the statements one by one instead.
    for stmt in SCHEMA.split(";"):
        if stmt.strip():
            conn.execute(stmt)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on an exception: all of it or none of it."""
    conn.execute("BEGIN IMMEDIATE")  # take the write lock now: no read-to-write upgrade deadlock
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def insert(conn: sqlite3.Connection, run: Run, decision: Decision | None = None) -> int:
    """Insert a run (and its decision) inside the caller's transaction; returns the run's id."""
    js = lambda x: json.dumps(x, sort_keys=True, default=str)  # noqa: E731
    cur = conn.execute(
        "INSERT INTO runs (kind, status, started_at, finished_at, config_key, config_label, "
        "workload, headline, server_url, gpu, git_commit, server_info, client, config, results) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            run.kind,
            run.status,
            run.started_at,
            run.finished_at,
            run.config_key,
            run.config_label,
            run.workload,
            run.headline,
            run.server_url,
            run.gpu,
            run.git_commit,
            js(run.server_info),
            js(run.client),
            js(run.config),
            js(run.results),
        ),
    )
    run_id = cur.lastrowid
    if decision is not None:
        conn.execute(
            "INSERT INTO decisions (run_id, decided_at, decision, change, reason, evidence) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (
                run_id,
                run.finished_at,
                decision.decision,
                decision.change,
                decision.reason,
                decision.evidence,
            ),
        )
    return run_id


def write(path: Path, run: Run, decision: Decision | None = None) -> int:
    """One run (and its decision) in one transaction; returns its id."""
    conn = connect(path)
    try:
        with transaction(conn):
            return insert(conn, run, decision)
    except sqlite3.Error as e:
        raise LedgerError(f"cannot write to the ledger {path}: {e}") from None
    finally:
        conn.close()
