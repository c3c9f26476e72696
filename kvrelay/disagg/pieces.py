"""A piece's row maths, under the agents' name: it lives in engine/kv_pieces.py, beside the
engine's workers that gather and install rows (the engine may not import disagg)."""

from __future__ import annotations

from kvrelay.engine.kv_pieces import (
    expected_bytes,
    gather,
    gather_rows,
    local_rows,
    page_rows,
    piece_rows,
    scatter,
)

__all__ = [
    "expected_bytes",
    "gather",
    "gather_rows",
    "local_rows",
    "page_rows",
    "piece_rows",
    "scatter",
]
