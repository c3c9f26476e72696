"""What a PD transfer moves: a runner's caches as a list of named kinds, and which rows of each
kind a prompt chunk fills.

A runner's `transfer_layout()` is its pool's cache spec bound to the pool's tensors
(`cache.spec.cache_kinds`: `CacheKind`, defined beside the spec); the sender and the receiver
only ever touch the tensors through these descriptions, so a new cache kind needs no change here.
- unit "page": first dim = page, second = rows within a page. Row j of a request covers tokens
  [j * ratio, (j + 1) * ratio) and is final once all of them are computed (a compressed entry
  exists only when its window is complete; a value kept per page, such as DeepSeek-V4's
  compressor state at each page end, is one row of `page_size` tokens). `keep_last` > 0: a
  request continuing at token t reads only the rows of tokens [t - keep_last, t) (a sliding
  window; a per-page value read only when resuming at its page's end), so decode gets the rows
  of the prompt's last `keep_last` tokens only; a decode that caches the prompt's pages asks for
  `resume_rows`: also those a later prefix hit ending at the prompt's last full page boundary
  reads (paging.resume_rows_from: the window's rows from boundary - keep_last, i.e. prompt
  length mod page size rows more). Pages ending before that boundary are cached as not
  resumable, and a hit never ends on them (radix.py).
- unit "slot": first dim = the request's state slot (per-request state, e.g. a compressor's
  open window). Only its value after the whole prompt matters: it is sent once, at the end.
- `shard` (rank, world): the tensor holds only part `rank` of `world` equal parts of each row's
  first dim (a dense model's KV heads under tensor parallel). The layout describes, and the
  transfer moves, whole rows; installing keeps this rank's part, sending first gathers every
  rank's part (engine/tp_gather.py).
"""

from __future__ import annotations

import hashlib

from kvrelay.cache.spec import PAGE, SLOT, CacheKind
from kvrelay.engine.kv_pieces import page_rows

# PAGE, SLOT, CacheKind and page_rows (engine/kv_pieces.py) are re-exported: the agents' vocabulary.
__all__ = [
    "PAGE",
    "SLOT",
    "CacheKind",
    "describe_layout",
    "fingerprint",
    "layer_groups",
    "layout_difference",
    "max_piece_bytes",
    "page_rows",
]


def max_piece_bytes(kinds: list[CacheKind], max_tokens: int) -> int:
    """An upper bound on one piece's payload: every kind's rows for a whole `max_tokens` prompt
    (a piece carries some of the kinds, each for part of the prompt). What a receiver accepts
    from a peer before it allocates a byte."""
    total = 0
    for k in kinds:
        rows = 1 if k.unit == SLOT else -(-max_tokens // k.ratio) + 1
        total += rows * k.row_bytes
    return total


def describe_layout(kinds: list[CacheKind], page_size: int, vocab_size: int) -> list[str]:
    return [f"page_size={page_size} vocab={vocab_size}"] + [k.describe() for k in kinds]


def fingerprint(description: list[str]) -> str:
    """A short name of a layout: equal fingerprints mean equal descriptions."""
    digest = hashlib.sha256("\n".join(description).encode()).hexdigest()[:16]
    return f"kinds={len(description) - 1}:{digest}"


def layout_difference(mine: list[str], theirs: list[str]) -> str:
    """The first line where two layout descriptions differ, for the error message."""
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return f"entry {i}: here {a!r}, peer {b!r}"
    if len(mine) != len(theirs):
        return f"here {len(mine) - 1} cache kinds, peer {len(theirs) - 1}"
    return "descriptions equal"


def layer_groups(kinds: list[CacheKind], unit: str, layers_per_piece: int) -> list[list[CacheKind]]:
    """The kinds of one unit, grouped `layers_per_piece` layers at a time (one piece each)."""
    groups: dict[int, list[CacheKind]] = {}
    for k in kinds:
        if k.unit == unit:
            groups.setdefault(k.layer // max(layers_per_piece, 1), []).append(k)
    return list(groups.values())
