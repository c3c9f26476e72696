"""`kvrelay report`: the ledger as a Markdown status report: the latest results of each
configuration, the A/B decisions with their evidence, and the list of rejected changes."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from kvrelay.ledger import store

TITLE = "# kvrelay status report"
RECENT_AB = 10  # undecided A/B comparisons shown


def render(path: Path) -> str:
    """The report of the ledger at `path`; a clear note when there is no ledger or no run."""
    if not path.exists():
        return (
            f"{TITLE}\n\nThe ledger is empty: there is no ledger file at `{path}` yet. Runs of "
            "`kvrelay bench`, `verify`, `ab` and `repro` are recorded there.\n"
        )
    conn = store.connect(path, create=False)
    try:
        if not _has_runs(conn):
            return f"{TITLE}\n\nThe ledger at `{path}` is empty: no run has been recorded yet.\n"
        parts = [_header(conn, path), _latest(conn), _decisions(conn), _retread(conn)]
        parts.append(_undecided(conn))
    finally:
        conn.close()
    return "\n".join(parts)


def _has_runs(conn: sqlite3.Connection) -> bool:
    try:
        return conn.execute("SELECT 1 FROM runs LIMIT 1").fetchone() is not None
    except sqlite3.OperationalError:  # a file with no tables yet
        return False


def _cell(text: object) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text if text not in (None, "") else "-").replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _header(conn: sqlite3.Connection, path: Path) -> str:
    n, first, last = conn.execute(
        "SELECT count(*), min(finished_at), max(finished_at) FROM runs"
    ).fetchone()
    by_kind = ", ".join(
        f"{k} {c}"
        for k, c in conn.execute("SELECT kind, count(*) FROM runs GROUP BY kind ORDER BY kind")
    )
    return f"{TITLE}\n\nLedger `{path}`: {n} runs ({by_kind}), {first} to {last}.\n"


def _latest(conn: sqlite3.Connection) -> str:
    """Per configuration (most recently measured first): the latest run of each kind and workload."""
    out = ["## Latest results per configuration\n"]
    configs = conn.execute(
        "SELECT config_key, max(id) AS last FROM runs WHERE kind != 'ab' "
        "GROUP BY config_key ORDER BY last DESC"
    ).fetchall()
    if not configs:
        out.append("No bench, verify or repro runs yet.\n")
    for c in configs:
        rows = conn.execute(
            "SELECT * FROM runs WHERE id IN (SELECT max(id) FROM runs WHERE config_key = ? "
            "AND kind != 'ab' GROUP BY kind, workload) ORDER BY kind, workload",
            (c["config_key"],),
        ).fetchall()
        info = json.loads(rows[-1]["server_info"])
        out.append(f"### {rows[-1]['config_label']}\n")
        out.append(_provenance(c["config_key"], info, rows[-1]) + "\n")
        out.append(
            _table(
                ["kind", "workload", "finished (UTC)", "run", "status", "result"],
                [
                    [r["kind"], r["workload"], r["finished_at"], f"#{r['id']}", r["status"]]
                    + [r["headline"]]
                    for r in rows
                ],
            )
        )
    return "\n".join(out)


def _provenance(key: str, info: dict, run: sqlite3.Row) -> str:
    v = info.get("versions") or {}
    versions = ", ".join(f"{k} {v[k]}" for k in ("kvrelay", "torch", "transformers") if v.get(k))
    git = info.get("git") or {}
    server_commit = git.get("commit", "")[:12] + (" (dirty)" if git.get("dirty") else "")
    bits = [f"config `{key}`", f"GPU: {run['gpu'] or '?'}"]
    bits += [f"server {versions}"] if versions else []
    bits += [f"server commit {server_commit}"] if server_commit else []
    bits += [f"client commit {run['git_commit'][:12]}"] if run["git_commit"] else []
    if info.get("error"):
        bits.append(f"note: {info['error']}")
    return " · ".join(bits)


def _decisions(conn: sqlite3.Connection) -> str:
    rows = conn.execute(
        "SELECT d.*, r.workload FROM decisions d JOIN runs r ON r.id = d.run_id ORDER BY d.id DESC"
    ).fetchall()
    out = "## A/B decisions\n\n"
    if not rows:
        return out + "No decisions recorded (`kvrelay ab … --decide accept|reject --reason …`).\n"
    return out + _table(
        ["decided (UTC)", "decision", "change", "evidence", "workload", "reason", "run"],
        [
            [d["decided_at"], d["decision"].upper(), d["change"], d["evidence"], d["workload"]]
            + [d["reason"], f"#{d['run_id']}"]
            for d in rows
        ],
    )


def _retread(conn: sqlite3.Connection) -> str:
    rows = conn.execute(
        "SELECT * FROM decisions WHERE decision = 'reject' ORDER BY id DESC"
    ).fetchall()
    out = "## Do not retread\n\nChanges tried and rejected, with the reason given.\n\n"
    if not rows:
        return out + "Nothing rejected yet.\n"
    return out + "".join(
        f"- **{d['change']}**: {d['reason']} (evidence: {d['evidence']}; run #{d['run_id']}, "
        f"{d['decided_at']})\n"
        for d in rows
    )


def _undecided(conn: sqlite3.Connection) -> str:
    rows = conn.execute(
        "SELECT * FROM runs WHERE kind = 'ab' AND id NOT IN (SELECT run_id FROM decisions) "
        "ORDER BY id DESC LIMIT ?",
        (RECENT_AB,),
    ).fetchall()
    if not rows:
        return ""
    return "## Recent A/B comparisons without a decision\n\n" + _table(
        ["finished (UTC)", "workload", "verdict", "run"],
        [[r["finished_at"], r["workload"], r["headline"], f"#{r['id']}"] for r in rows],
    )
