"""Runs recorded by the bench tests go to a ledger of their own, never the user's."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger.db"
    monkeypatch.setenv("KVRELAY_LEDGER", str(path))
    return path
