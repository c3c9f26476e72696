"""The ledger on the command line: the --ledger flag every recording command takes, the recording
step those commands share, and `kvrelay report`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvrelay.ledger import record, store


def add_ledger_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ledger",
        default=None,
        metavar="PATH",
        help="SQLite ledger the run is recorded in ('off': none; default: $KVRELAY_LEDGER, "
        "else ~/.kvrelay/ledger.db)",
    )


def save_run(a: argparse.Namespace, kind: str, config: dict, results: dict, **kw) -> int | None:
    """record_run for a command: says where the run went; a ledger that cannot be written is a
    warning, never a failed benchmark."""
    try:
        run_id = record.record_run(a.ledger, kind, config, results, **kw)
    except store.LedgerError as e:
        sys.stderr.write(f"kvrelay {kind}: warning: run not recorded: {e}\n")
        return None
    if run_id is not None:
        sys.stdout.write(f"recorded as run #{run_id} in {store.resolve_path(a.ledger)}\n")
    return run_id


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    r = subparsers.add_parser(
        "report",
        help="write a Markdown status report from the run ledger",
        description="Latest results per server configuration, A/B decisions with their evidence, "
        "and a 'do not retread' list of rejected changes, from the ledger that bench, verify, "
        "ab and repro record into.",
    )
    add_ledger_arg(r)
    r.add_argument("--out", default=None, metavar="FILE.md", help="write here (default: stdout)")
    r.set_defaults(func=cmd_report)
    return r


def cmd_report(a: argparse.Namespace) -> int:
    from kvrelay.ledger.report import render

    path = store.resolve_path(a.ledger)
    if path is None:
        sys.stderr.write("kvrelay report: the ledger is off (--ledger off / KVRELAY_LEDGER=off)\n")
        return 2
    try:
        text = render(path)
    except store.LedgerError as e:
        sys.stderr.write(f"kvrelay report: {e}\n")
        return 2
    if a.out:
        Path(a.out).write_text(text)
        sys.stdout.write(f"wrote {a.out}\n")
    else:
        sys.stdout.write(text)
    return 0
