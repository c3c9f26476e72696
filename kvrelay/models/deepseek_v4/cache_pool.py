"""DeepSeek-V4's caches as paged pools, one tensor per (layer, cache kind).

One page holds `page_size` raw tokens of every kind (page_size is a multiple of every compress
ratio, so a compressed entry never straddles pages):
- `swa_kv`        every layer: the raw K = V of each token        [pages, P, head_dim]
- `c{r}_kv`       compressed layers: entry e covers tokens e*r ..  [pages, P / r, head_dim]
- `c{r}_index_k`  CSA layers: the indexer's keys, same layout     [pages, P / 4, index_head_dim]
                  (bf16/model dtype, or fp8 e4m3 with a per-row scale)
The compressors' partial-window state is per request, not per token: a state slot (one per
running request) holds, for each compressor, the projected kv/score rows of the last two
windows (row = position % 2r: the open one and the one before it) and, for the overlapping
ratio-4 compressors, the first-half channels of the last two closed windows (row = position %
2r of the window's rows). Positions are implicit in the request's token count.

Why two windows: a speculative verify step writes the rows of drafts that may be rejected. A
rejected draft that closes a window would otherwise write the next window's rows over the
committed window's and replace the prev halves the committed tokens' next close needs. With
K <= 4 = the smallest ratio, the rows a verify step writes span at most the committed window
and the one after it, so what a rejected draft writes lands on rows nobody reads before the
same positions are computed again: no snapshot, no rollback, no recompute.

For the prefix cache a page is a pure function of the tokens up to its end, so that any request
with the same prefix can share it: every token's window row is written (not only the last
window's), and each page keeps, for every overlapping compressor, the prev state after its last
token (`page_prev_*`, the first halves of the window that closes at the page end). At a page
end every compressor's open window is empty (the page size is a multiple of every ratio), so
that prev state is all a request continuing from a shared page needs in its slot
(`restore_slot`). The `page_prev_*` tensors are read only after a prefix hit, yet they travel
like every other kind: a PD decode caches the pages it receives, and a later local hit there (a
preempted request recomputing) restores its slot from them.

Every tensor is declared in the spec (cache_spec.py) and allocated from it (`tensors`, also
`kinds`: per-page ones first dim = page; per-request ones first dim = slot), so a transfer ships
a request's pages and slot by name, and a page received holds what a page computed here holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.cache.paging import row_index
from kvrelay.models.deepseek_v4.cache_spec import FP8 as _FP8
from kvrelay.models.deepseek_v4.cache_spec import dsv4_cache_spec, dsv4_page_size
from kvrelay.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from kvrelay.models.deepseek_v4.state import CompressorState, LayerState

__all__ = ["DeepseekV4CachePool", "dsv4_page_size"]
_FP8_MAX = 448.0


def _fp8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 rows with one fp32 scale each (amax / 448)."""
    scale = rows.float().abs().amax(dim=-1).clamp(min=1e-12) / _FP8_MAX
    return (rows.float() / scale[:, None]).to(_FP8), scale


@dataclass
class _CompressorSlots:
    """Per-slot partial-window state of one compressor (wide dtype)."""

    ratio: int
    overlap: bool
    pending_kv: torch.Tensor  # [slots, 2 * ratio, coff*d], row = position % (2 * ratio)
    pending_score: torch.Tensor
    prev_kv: torch.Tensor | None  # [slots, 2 * ratio, d] (overlap only), the same rows
    prev_score: torch.Tensor | None
    page_prev_kv: torch.Tensor | None  # [pages, ratio, d] prev state at each page's end
    page_prev_score: torch.Tensor | None


class DeepseekV4CachePool:
    def __init__(
        self,
        cfg: DeepseekV4Config,
        num_pages: int,
        page_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        index_k_dtype: str = "auto",
        mtp_layers: int = 0,
    ) -> None:
        self.spec = dsv4_cache_spec(cfg, page_size, dtype, index_k_dtype, mtp_layers)
        self.cfg, self.page_size, self.dtype, self.device = cfg, page_size, dtype, device
        self.num_pages, self.num_slots = num_pages, num_slots
        self.index_fp8 = index_k_dtype == "fp8"
        self.window = cfg.sliding_window
        # name -> tensor (pages or slots first), allocated from the spec
        self.tensors = self.kinds = self.spec.allocate(num_pages, num_slots, device)
        t = self.tensors

        def slots(prefix: str, ratio: int, overlap: bool) -> _CompressorSlots:
            def get(part: str) -> torch.Tensor | None:
                return t.get(f"{prefix}.{part}")

            page_prev = [get(p) for p in ("page_prev_kv", "page_prev_score")]
            return _CompressorSlots(
                ratio,
                overlap,
                get("pending_kv"),
                get("pending_score"),
                get("prev_kv"),
                get("prev_score"),
                *(None if x is None else x[:, 0] for x in page_prev),  # [pages, ratio, d]
            )

        self.swa: list[torch.Tensor] = []
        self.entries: list[torch.Tensor | None] = []
        self.index_k: list[torch.Tensor | None] = []
        self.index_k_scale: list[torch.Tensor | None] = []
        self.comp_slots: list[_CompressorSlots | None] = []
        self.index_slots: list[_CompressorSlots | None] = []
        for i, kind in enumerate(cfg.layer_types):
            self.swa.append(t[f"L{i}.swa_kv"])
            entries = index_k = scale = comp = idx = None
            if kind != SLIDING:
                r = cfg.compress_ratio(i)
                entries = t[f"L{i}.c{r}_kv"]
                comp = slots(f"L{i}.c{r}_state", r, kind == CSA)
            if kind == CSA:
                r = cfg.csa_compress_ratio
                index_k = t[f"L{i}.c{r}_index_k"]
                scale = t.get(f"L{i}.c{r}_index_k_scale")
                idx = slots(f"L{i}.c{r}_index_state", r, True)
            self.entries.append(entries)
            self.index_k.append(index_k)
            self.index_k_scale.append(scale)
            self.comp_slots.append(comp)
            self.index_slots.append(idx)
        # the MTP blocks' window rows after the layers' (sliding: nothing else)
        self.swa += [t[f"MTP{j}.swa_kv"] for j in range(mtp_layers)]

    # -- rows of a request ------------------------------------------------------------------
    def _read(self, pool: torch.Tensor, pages: torch.Tensor, first: int, last: int, r: int):
        idx = row_index(pages, first, last, r, self.page_size, pool.shape[1])
        return pool.flatten(0, 1)[idx]

    def _write(self, pool, pages, first: int, rows: torch.Tensor, r: int) -> None:
        if rows.shape[0]:
            idx = row_index(pages, first, first + rows.shape[0], r, self.page_size, pool.shape[1])
            pool.flatten(0, 1)[idx] = rows.to(pool.dtype)

    def _read_index_k(self, i: int, pages: torch.Tensor, n: int) -> torch.Tensor:
        r = self.cfg.csa_compress_ratio
        k = self._read(self.index_k[i], pages, 0, n, r)
        if not self.index_fp8:
            return k
        scale = self._read(self.index_k_scale[i], pages, 0, n, r)
        return (k.float() * scale[:, None]).to(self.dtype)

    def _write_index_k(self, i: int, pages: torch.Tensor, first: int, rows: torch.Tensor) -> None:
        r = self.cfg.csa_compress_ratio
        if not self.index_fp8:
            self._write(self.index_k[i], pages, first, rows, r)
            return
        q, scale = _fp8_rows(rows)
        self._write(self.index_k[i], pages, first, q, r)
        self._write(self.index_k_scale[i], pages, first, scale, r)

    # -- rows by flat pool index (the batched forward) ----------------------------------------
    def store_index_k(self, i: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        """Write index keys [n, d] at flat rows [n] (fp8: with their per-row scale)."""
        flat = self.index_k[i].flatten(0, 1)
        if not self.index_fp8:
            flat.index_copy_(0, rows, keys.to(flat.dtype))
            return
        q, scale = _fp8_rows(keys)
        flat.view(torch.uint8).index_copy_(0, rows, q.view(torch.uint8))  # no fp8 index_copy
        self.index_k_scale[i].flatten(0, 1).index_copy_(0, rows, scale)

    def index_k_rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(keys [rows, d], per-row scale [rows] or None) of layer i, flat over pages."""
        scale = self.index_k_scale[i]
        return self.index_k[i].flatten(0, 1), None if scale is None else scale.flatten(0, 1)

    # -- one layer's state of one request, as the model code takes it ----------------------
    def load_layer(self, i: int, pages: torch.Tensor, slot: int, start: int) -> LayerState:
        """The state after `start` tokens: window KV, compressed entries, compressor state."""
        w0 = max(0, start - (self.window - 1))
        state = LayerState(window=self._read(self.swa[i], pages, w0, start, 1))
        if self.entries[i] is not None:
            s = self.comp_slots[i]
            entries = self._read(self.entries[i], pages, 0, start // s.ratio, s.ratio)
            state.compressor = self._load_slot(s, slot, start, entries)
        if self.index_k[i] is not None:
            s = self.index_slots[i]
            keys = self._read_index_k(i, pages, start // s.ratio)
            state.indexer = self._load_slot(s, slot, start, keys)
        return state

    def store_layer(
        self, i: int, pages: torch.Tensor, slot: int, start: int, n: int, new: LayerState
    ) -> None:
        """Write what tokens start..start+n-1 added: their window KV, the entries they
        completed, the prev state at the page ends they reached, and the compressor state
        after them."""
        rows = new.new_kv  # every new row (None: a caller without it; the last window's)
        if rows is None:
            rows = new.window[new.window.shape[0] - min(n, new.window.shape[0]) :]
        if rows.shape[0]:
            self._write(self.swa[i], pages, start + n - rows.shape[0], rows, 1)
        if self.entries[i] is not None:
            s = self.comp_slots[i]
            first = start // s.ratio
            self._write(self.entries[i], pages, first, new.compressor.entries[first:], s.ratio)
            self._store_page_prev(s, pages, first, new.compressor)
            self._store_slot(s, slot, start + n, new.compressor)
        if self.index_k[i] is not None:
            s = self.index_slots[i]
            first = start // s.ratio
            self._write_index_k(i, pages, first, new.indexer.entries[first:])
            self._store_page_prev(s, pages, first, new.indexer)
            self._store_slot(s, slot, start + n, new.indexer)

    def _store_page_prev(
        self, s: _CompressorSlots, pages: torch.Tensor, first: int, state: CompressorState
    ) -> None:
        """The prev state at each page end the windows closed in this call (entries first..)
        reached."""
        if state.closed_heads is None:
            return
        per_page = self.page_size // s.ratio
        for k in range(state.closed_heads[0].shape[0]):
            if (first + k + 1) % per_page == 0:
                page = pages[(first + k + 1) // per_page - 1]
                s.page_prev_kv[page] = state.closed_heads[0][k]
                s.page_prev_score[page] = state.closed_heads[1][k]

    def restore_slot(self, slot: int, page: int, end: int) -> None:
        """Fill `slot` with the compressor state after the last token of `page`, which ends at
        token `end` (a request continuing from a cached prefix that ends there): only the
        overlapping compressors' prev state; every open window is empty at a page end."""
        for s in self.comp_slots + self.index_slots:
            if s is not None and s.overlap:
                rows = window_rows(s.ratio, end // s.ratio - 1)
                s.prev_kv[slot, rows] = s.page_prev_kv[page]
                s.prev_score[slot, rows] = s.page_prev_score[page]

    @staticmethod
    def _load_slot(
        s: _CompressorSlots, slot: int, start: int, entries: torch.Tensor
    ) -> CompressorState:
        w, p = divmod(start, s.ratio)
        rows = window_rows(s.ratio, w, p)
        state = CompressorState(entries, s.pending_kv[slot, rows], s.pending_score[slot, rows])
        if s.overlap and w:
            prev = window_rows(s.ratio, w - 1)
            state.prev_kv, state.prev_score = s.prev_kv[slot, prev], s.prev_score[slot, prev]
        return state

    @staticmethod
    def _store_slot(s: _CompressorSlots, slot: int, end: int, state: CompressorState) -> None:
        """The open window's rows, and where the call closed windows, the last one's rows and
        (overlapping) the first halves of the last two: what a later call starting anywhere
        in the last two windows reads (a verify step's rejected rows are not committed)."""
        r = s.ratio
        w, p = divmod(end, r)
        rows = window_rows(r, w, p)
        s.pending_kv[slot, rows] = state.pending_kv
        s.pending_score[slot, rows] = state.pending_score
        if state.closed_rows is not None:
            rows = window_rows(r, w - 1)
            s.pending_kv[slot, rows] = state.closed_rows[0]
            s.pending_score[slot, rows] = state.closed_rows[1]
        if s.overlap and state.closed_heads is not None:
            m = state.closed_heads[0].shape[0]  # windows w - m .. w - 1 closed in the call
            for k in range(max(0, m - 2), m):
                rows = window_rows(r, w - m + k)
                s.prev_kv[slot, rows] = state.closed_heads[0][k]
                s.prev_score[slot, rows] = state.closed_heads[1][k]


def window_rows(ratio: int, window: int, count: int | None = None) -> slice:
    """A state slot's rows of the first `count` (default all) positions of `window`."""
    first = window % 2 * ratio
    return slice(first, first + (ratio if count is None else count))
