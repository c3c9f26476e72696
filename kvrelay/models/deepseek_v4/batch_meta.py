"""What one batched DeepSeek-V4 forward reads about its batch, built once per step on the host
(`build_meta`) and the index tensors every layer of a kind shares, derived on the device
(`StepIndex`), so that a decode step is a fixed sequence of kernels a CUDA graph can replay.

A batch is varlen: sequence b contributes rows tok_base[b] .. tok_base[b] + n_b - 1 of the T
rows, its tokens at positions chunk_start[b] .. chunk_end[b] - 1. Compressed entry e of ratio
r of a sequence covers its tokens [e*r, (e+1)*r) and lives in pool row
page_table[b, e*r // P] * (P // r) + e % (P // r). Padding rows (CUDA graph buckets) belong to
sequences whose pages and state slot are the dummy page 0 and slot 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Closers:
    """Rows whose token closes a compression window of one ratio (entry (pos + 1) / r - 1 is
    complete after it). `valid` is False for padding; `keeps_prev` marks each sequence's last
    two closers in the step (they leave their windows' first halves in the state slot)."""

    rows: torch.Tensor  # [C] long
    valid: torch.Tensor  # [C] bool
    keeps_prev: torch.Tensor  # [C] bool


def keeps_prev(closing: np.ndarray, pos: np.ndarray, end: np.ndarray, r: int) -> np.ndarray:
    """Which closing rows (at positions `pos`, of sequences ending at `end`) close one of their
    sequence's last two windows closed in the step: a later step starting anywhere in the last
    two windows reads those halves (cache_pool.py: why two)."""
    return closing & (pos + 1 >= (end // r - 1) * r)


@dataclass
class BatchMeta:
    positions: torch.Tensor  # [T] long
    seq: torch.Tensor  # [T] long, the row's sequence
    page_table: torch.Tensor  # [B, max_pages] long (padding: page 0)
    slots: torch.Tensor  # [B] long compressor-state slot (padding: 0)
    chunk_start: torch.Tensor  # [B] long tokens cached before this step
    chunk_end: torch.Tensor  # [B] long
    tok_base: torch.Tensor  # [B] long first row of the sequence
    closers: dict[int, Closers]  # per compress ratio
    max_entries: dict[int, int]  # per ratio: entries any sequence may see (python int)
    page_size: int

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def build_meta(
    starts: list[int],
    counts: list[int],
    pages: list[list[int]],
    slots: list[int],
    ratios: tuple[int, ...],
    page_size: int,
    device: torch.device,
    max_entries: dict[int, int] | None = None,
    closers_per_row: bool = False,
) -> BatchMeta:
    """Host-side metadata of sequences that add counts[b] tokens after starts[b] cached ones.
    `closers_per_row` (decode graphs) lists every row as a potential closer with a validity
    flag, so that C does not depend on the positions; otherwise only the true closers are
    listed. `max_entries` overrides the per-ratio entry bound (graphs fix it per bucket)."""
    b_n = len(starts)
    st = np.asarray(starts, dtype=np.int64)
    cnt = np.asarray(counts, dtype=np.int64)
    end = st + cnt
    base = np.concatenate(([0], np.cumsum(cnt)[:-1])).astype(np.int64)
    seq = np.repeat(np.arange(b_n, dtype=np.int64), cnt)
    pos = np.arange(int(cnt.sum()), dtype=np.int64) - base[seq] + st[seq]
    width = max(1, max(len(p) for p in pages))
    table = np.zeros((b_n, width), dtype=np.int64)
    for b, p in enumerate(pages):
        table[b, : len(p)] = p
    closers = {}
    for r in ratios:
        closing = (pos + 1) % r == 0
        if closers_per_row:
            rows = np.arange(pos.shape[0], dtype=np.int64)
            valid = closing
        else:
            rows = np.nonzero(closing)[0]
            valid = np.ones(rows.shape[0], dtype=bool)
        closers[r] = (rows, valid, keeps_prev(valid, pos[rows], end[seq[rows]], r))

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    if max_entries is None:
        max_entries = {r: max(1, int(end.max()) // r) for r in ratios}
    return BatchMeta(
        positions=dev(pos),
        seq=dev(seq),
        page_table=dev(table),
        slots=dev(np.asarray(slots, dtype=np.int64)),
        chunk_start=dev(st),
        chunk_end=dev(end),
        tok_base=dev(base),
        closers={r: Closers(dev(a), dev(v), dev(k)) for r, (a, v, k) in closers.items()},
        max_entries=dict(max_entries),
        page_size=page_size,
    )


@dataclass(frozen=True)
class CompressPlan:
    """Where one compress ratio's step reads and writes, the same for every layer of that
    ratio: the closing windows' first positions, the pool rows their entries go to (the dummy
    page for padding closers), each row's flat state-slot row (slot * 2r + position % 2r; the
    dummy slot 0 for rows before the sequence's last two windows), each closer's half-window
    of prev rows (slot * 2 + window % 2; 0: not one of the last two closed), each row's
    position-bias row, and the page whose end the closing window reaches (its prev state is
    kept there for the prefix cache; 0, the dummy page: not a page end)."""

    window_start: torch.Tensor  # [C]
    store_rows: torch.Tensor  # [C]
    pending_rows: torch.Tensor  # [T]
    prev_rows: torch.Tensor  # [C]
    bias_rows: torch.Tensor  # [T]
    page_prev: torch.Tensor  # [C]


@dataclass
class StepIndex:
    """Device-side index tensors derived from a BatchMeta, computed on first use in a step and
    shared by every layer that needs them."""

    meta: BatchMeta
    window: int
    _cache: dict = field(default_factory=dict)

    def _memo(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def rope(
        self, table, dtype: torch.dtype, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin under `table` (a RopeTable) of every row's position, or of `positions`
        (a tensor memoized in this step), computed once per step for all layers whose tables
        are equal."""
        pos = self.meta.positions if positions is None else positions
        return self._memo(("rope", table.key, dtype, id(pos)), lambda: table.cos_sin(pos, dtype))

    def swa_rows(self) -> torch.Tensor:
        """[T] the flat sliding-window pool row of each row's token."""
        m = self.meta
        return self._memo("swa_rows", lambda: self.token_rows(m.seq, m.positions))

    def token_rows(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat per-token pool rows of positions `pos` (>= 0) of sequences `seq`."""
        m, p = self.meta, self.meta.page_size
        return m.page_table[seq, pos // p] * p + pos % p

    def window_idx(self) -> torch.Tensor:
        """[T, window] pool rows of positions pos - window + 1 .. pos; -1 before position 0."""

        def make() -> torch.Tensor:
            m = self.meta
            offs = torch.arange(self.window, device=m.positions.device) - (self.window - 1)
            pos = m.positions[:, None] + offs[None, :]
            rows = self.token_rows(m.seq[:, None].expand_as(pos), pos.clamp(min=0))
            return torch.where(pos >= 0, rows, -1)

        return self._memo("window", make)

    def entry_rows_of(self, ratio: int, seq: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        """Pool rows of entries `entry` (>= 0) of sequences `seq`."""
        m, p = self.meta, self.meta.page_size
        return m.page_table[seq, entry * ratio // p] * (p // ratio) + entry % (p // ratio)

    def entry_rows(self, ratio: int) -> torch.Tensor:
        """[B, max_entries] pool rows of each sequence's entries 0 .. max_entries - 1 (rows of
        entries past the page table's end point at the dummy page)."""

        def make() -> torch.Tensor:
            m, p = self.meta, self.meta.page_size
            per_page = p // ratio
            e = torch.arange(m.max_entries[ratio], device=m.positions.device)
            col = (e * ratio // p).clamp(max=m.page_table.shape[1] - 1)
            return m.page_table[:, col] * per_page + e % per_page

        return self._memo(("entries", ratio), make)

    def compress_plan(self, ratio: int) -> CompressPlan:
        def make() -> CompressPlan:
            m, r = self.meta, ratio
            cl = m.closers[r]
            seq = m.seq[cl.rows]
            wstart = m.positions[cl.rows] + 1 - r
            rows = self.entry_rows_of(r, seq, wstart // r)
            last_two = m.positions >= (m.chunk_end[m.seq] // r - 1) * r
            keep_slot = torch.where(last_two, m.slots[m.seq], 0)
            end, p = wstart + r, m.page_size
            ended = m.page_table[seq, (end // p - 1).clamp(min=0)]
            half = m.slots[seq] * 2 + wstart // r % 2
            return CompressPlan(
                window_start=wstart,
                store_rows=torch.where(cl.valid, rows, 0),
                pending_rows=keep_slot * 2 * r + m.positions % (2 * r),
                prev_rows=torch.where(cl.keeps_prev, half, 0),
                bias_rows=m.positions % r,
                page_prev=torch.where(cl.valid & (end % p == 0), ended, 0),
            )

        return self._memo(("compress", ratio), make)

    def visible(self, ratio: int) -> torch.Tensor:
        """[T] entries of this ratio each row's token may attend to: (pos + 1) // ratio."""
        return self._memo(("visible", ratio), lambda: (self.meta.positions + 1) // ratio)

    def all_entries_idx(self, ratio: int) -> torch.Tensor:
        """[T, max_entries] pool rows of every visible entry (HCA), -1 for the rest."""

        def make() -> torch.Tensor:
            m = self.meta
            rows = self.entry_rows(ratio)[m.seq]
            e = torch.arange(rows.shape[1], device=rows.device)
            return torch.where(e[None, :] < self.visible(ratio)[:, None], rows, -1)

        return self._memo(("all_entries", ratio), make)
