"""What a run stores: the server's configuration (over HTTP), the client's environment, and the
results; `record_run` is the one call that bench, verify, ab and repro make."""

from __future__ import annotations

import platform
import socket
import sys
from pathlib import Path

import httpx

from kvrelay import provenance
from kvrelay.config import api_key_headers, env_snapshot
from kvrelay.ledger import configs, store


def fetch_server_info(url: str, timeout_s: float = 10.0) -> dict:
    """GET /server_info; a server without it (not kvrelay) is described by /v1/models. Never
    raises: what could not be learned is said in 'error'."""
    base = url.rstrip("/")
    info: dict = {"url": base}
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, headers=api_key_headers()) as c:
            r = c.get(base + "/server_info")
            if r.status_code == 200:
                return info | r.json()
            r = c.get(base + "/v1/models")
            r.raise_for_status()
            info["model"] = r.json()["data"][0]["id"]
            info["error"] = "no /server_info: the server's configuration is unknown"
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        info["error"] = f"{type(e).__name__}: {e}"
    return info


def client_environment() -> dict:
    """The machine and checkout the command ran from."""
    return {
        "versions": provenance.versions(),
        "git": provenance.git_commit(),
        "env": env_snapshot(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "argv": sys.argv,
    }


def record_run(
    ledger_path: str | Path | None,
    kind: str,
    config: dict,
    results: dict,
    *,
    server_url: str | None = None,
    server_info: dict | None = None,
    workload: str = "",
    headline: str = "",
    started_at: float | None = None,
    status: str = "ok",
    decision: store.Decision | None = None,
) -> int | None:
    """Store one finished run; returns its id, or None when the ledger is off.

    ledger_path: the --ledger flag (None: KVRELAY_LEDGER or ~/.kvrelay/ledger.db; 'off': none).
    kind: bench | verify | ab | repro. config: the run's settings; results: its JSON.
    server_info: GET /server_info of the server measured, fetched from server_url when not given.
    workload and headline: one line each for the report (what ran, what came out).
    started_at: time.time() at the start. Raises store.LedgerError if the file cannot be written.
    """
    path = store.resolve_path(None if ledger_path is None else str(ledger_path))
    if path is None:
        return None
    if server_info is None:
        server_info = fetch_server_info(server_url) if server_url else {}
    client = client_environment()
    git = client["git"]
    run = store.Run(
        kind=kind,
        status=status,
        started_at=None if started_at is None else store.utc_now(started_at),
        finished_at=store.utc_now(),
        config_key=configs.config_key(server_info),
        config_label=configs.config_label(server_info),
        workload=workload,
        headline=headline,
        server_url=server_url or server_info.get("url"),
        gpu=server_info.get("gpu"),
        git_commit=None if git is None else git["commit"] + ("-dirty" if git["dirty"] else ""),
        server_info=server_info,
        client=client,
        config=config,
        results=results,
    )
    return store.write(path, run, decision)
