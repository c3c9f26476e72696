"""CUDA graphs for DeepSeek-V4 decode and verify steps: one graph per (batch bucket, rows per
request q, context bucket), captured on first use. A plain decode step has one token per request
(q = 1); a speculative verify step up to q = 1 + drafts: request b's tokens fill rows b*q ..
b*q + n_b - 1 and the rows after them, up to (b+1)*q, belong to a filler sequence of its own (in
the dummy page 0 and state slot 0, positions from 0), so one graph covers any counts <= q. The
context bucket fixes how many compressed entries a step may address and the page-table width,
so a short context does not pay for the longest one. With the MTP drafter (`mtp`), each graph
also keeps every row's final streams, and a second graph of the same key runs the MTP block over
them once the step's tokens are committed.

Capture runs on padding only (every row in the dummy page 0 and state slot 0), then the live
batch is copied into the static buffers and replayed: a warm-up on live rows would apply the
step twice (the compressors' state update is not idempotent).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.layers import batch_invariant
from kvrelay.models.base import BUCKETS
from kvrelay.models.deepseek_v4.batch_meta import BatchMeta, Closers, StepIndex, keeps_prev
from kvrelay.models.deepseek_v4.batched import forward_batched, mtp_drafts
from kvrelay.models.deepseek_v4.staging import Staging
from kvrelay.models.deepseek_v4.step import Dsv4Step

MIN_CONTEXT = 512


def context_bucket(tokens: int, page_size: int) -> int:
    """Power of two >= tokens (at least MIN_CONTEXT), a multiple of the page size."""
    c = MIN_CONTEXT
    while c < tokens:
        c *= 2
    return -(-c // page_size) * page_size


def _context(step: Dsv4Step) -> int:
    """Tokens of the longest sequence after the step."""
    return max(s + c for s, c in zip(step.starts, step.counts, strict=True))


@dataclass
class Captured:
    """One key's graphs and their static outputs."""

    graph: torch.cuda.CUDAGraph | None
    logits: torch.Tensor  # [bs * q, V] every row's
    streams: torch.Tensor | None = None  # [bs * q, hc, hidden] (mtp)
    meta: BatchMeta | None = None  # (mtp: the MTP pass reads the step's)
    index: StepIndex | None = None
    mtp_graph: torch.cuda.CUDAGraph | None = None
    drafts: torch.Tensor | None = None  # [bs, k]: each request's MTP drafts


class Dsv4GraphRunner:
    def __init__(self, runner, max_bs: int, max_context: int, max_q: int = 1) -> None:
        # runner: the family's side of the runner contract (runnable.DeepseekV4Runnable)
        self.runner = runner
        self.mtp = runner.mtp
        self.buckets = [b for b in BUCKETS if b <= max_bs]
        self.max_bs = self.buckets[-1]
        self.max_q = max_q
        self.max_context = context_bucket(max_context, runner.page_size)
        self.min_context = min(context_bucket(1, runner.page_size), self.max_context)
        rows, seqs, dev = self.max_bs * max_q, 2 * self.max_bs, runner.device
        self.max_pages = self.max_context // runner.page_size
        ratios = runner.ratios
        # every input a graph reads, in one staging buffer: the MTP pass's first, then the step's
        sizes = {"next_ids": rows, "draft_rows": self.max_bs, "draft_valid": self.max_bs}
        sizes |= {"input_ids": rows, "positions": rows, "seq": rows}
        sizes |= {f"valid{r}": rows for r in ratios} | {f"keep{r}": rows for r in ratios}
        sizes |= {"slots": seqs, "chunk_start": seqs, "chunk_end": seqs, "tok_base": seqs}
        sizes["page_table"] = seqs * self.max_pages
        self.stage = Staging(sizes, dev)
        self.k = runner.cfg.speculative.num_draft_tokens  # (mtp) drafts per request
        self.rows = torch.arange(rows, device=dev)
        self.graphs: dict[tuple[int, int, int], Captured] = {}
        self.pool = None

    def fits(self, context: int, batch_size: int) -> bool:
        return batch_size <= self.max_bs and context <= self.max_context

    def can_run(self, step: Dsv4Step, profile) -> bool:
        """A decode or verify step (at most max_q new tokens per request, every wanted row
        sampled) that a captured graph covers; profiled steps run eagerly so their components
        can be timed."""
        return (
            profile is None
            and not step.all_rows
            and 1 <= min(step.counts, default=0)
            and max(step.counts) <= self.max_q
            and step.n_sampled == len(step.rows)
            and self.fits(_context(step), len(step.counts))
        )

    def run(self, step: Dsv4Step, profile=None) -> torch.Tensor:
        """Float32 logits of the step's sampled rows, from the graph of its buckets."""
        b, q = len(step.counts), max(step.counts)
        bs = next(x for x in self.buckets if x >= b)
        ctx = context_bucket(_context(step), self.runner.page_size)
        self.capture(bs, ctx, q)
        live = self._load(step, bs, q, ctx)
        got = self._replay(bs, ctx, q)
        if self.mtp:
            self.runner.drafts_from(
                step, lambda ids, rows: self._draft(bs, ctx, q, live, ids, rows)
            )
        if q == 1 and len(step.rows) == b:  # one row per request, all sampled, in order
            return got.logits[:b].float()
        rows = torch.from_numpy(live[step.rows]).to(got.logits.device, non_blocking=True)
        return got.logits[rows].float()

    def run_lists(
        self,
        input_ids: list[int],
        starts: list[int],
        pages: list[list[int]],
        slots: list[int],
    ) -> torch.Tensor:
        """One decode token per sequence (token input_ids[b] at position starts[b]) -> logits."""
        n = len(input_ids)
        step = Dsv4Step(input_ids, starts, [1] * n, pages, slots, list(range(n)), n)
        return self.run(step)

    @staticmethod
    def _num_seqs(bs: int, q: int) -> int:
        return bs if q == 1 else 2 * bs  # (q > 1: each request's filler sequence)

    def _meta(self, bs: int, ctx: int, q: int) -> BatchMeta:
        """The step's metadata as views of the staging buffer (closer flags made bool here:
        inside the graph)."""
        ps, t, n = self.runner.page_size, bs * q, self._num_seqs(bs, q)
        st, width = self.stage.device, ctx // ps
        closers = {
            r: Closers(self.rows[:t], st(f"valid{r}", t) != 0, st(f"keep{r}", t) != 0)
            for r in self.runner.ratios
        }
        return BatchMeta(
            positions=st("positions", t),
            seq=st("seq", t),
            page_table=st("page_table", n * width).view(n, width),
            slots=st("slots", n),
            chunk_start=st("chunk_start", n),
            chunk_end=st("chunk_end", n),
            tok_base=st("tok_base", n),
            closers=closers,
            max_entries={r: ctx // r for r in self.runner.ratios},
            page_size=ps,
        )

    def _forward(self, bs: int, ctx: int, q: int) -> Captured:
        r, t = self.runner, bs * q
        meta = self._meta(bs, ctx, q)
        index = StepIndex(meta, r.model_cfg.sliding_window)
        streams = [] if self.mtp else None
        ids = self.stage.device("input_ids", t)
        logits = forward_batched(
            r.model, ids, meta, r.cache, self.rows[:t], r.ops, r.kernels, streams_out=streams,
            index=index,
        )  # fmt: skip
        if not self.mtp:
            return Captured(None, logits)
        return Captured(None, logits, streams[0], meta, index)

    def _mtp_forward(self, bs: int, q: int, got: Captured) -> torch.Tensor:
        r, t = self.runner, bs * q
        st = self.stage.device
        return mtp_drafts(
            r.model, got.streams, st("next_ids", t), got.meta, got.index, r.cache,
            st("draft_rows", bs), st("draft_valid", bs) != 0, r.ops, r.kernels, self.k,
        )  # fmt: skip

    def capture(self, bs: int, ctx: int, q: int = 1) -> None:
        """The graph(s) of (batch bucket, context bucket, rows per request), unless there."""
        if (bs, ctx, q) in self.graphs:
            return
        # `--deterministic`: captured inside the invariant mode (a replay runs outside it)
        with batch_invariant.scope(self.runner.cfg.deterministic):
            self._capture(bs, ctx, q)

    def _capture(self, bs: int, ctx: int, q: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks kernels
            self._warm_up(bs, ctx, q)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call on another thread (a PD transfer opening an IPC handle, a
        # leftover engine) must not invalidate this capture; this thread's calls are still checked.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            got = self._forward(bs, ctx, q)
        self.pool = graph.pool()
        got.graph = graph
        if self.mtp:  # in the same pool: it reads the forward graph's streams and index
            got.mtp_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(got.mtp_graph, pool=self.pool, capture_error_mode="thread_local"):
                got.drafts = self._mtp_forward(bs, q, got)
        self.graphs[(bs, ctx, q)] = got

    def _warm_up(self, bs: int, ctx: int, q: int) -> None:
        """The key's forward (and MTP pass) run once, eagerly, on padding: every input is
        loaded, the MTP pass's too (what a step of another key left there, a draft row past
        this key's rows, would index out of bounds)."""
        self._load(Dsv4Step([], [], [], [], [], [], 0), bs, q, ctx)
        st = self.stage
        for name in ("next_ids", "draft_rows", "draft_valid"):
            st.put(name, np.zeros(st.size[name], dtype=np.int64))
        st.send("next_ids", "draft_valid")
        warm = self._forward(bs, ctx, q)
        if self.mtp:
            self._mtp_forward(bs, q, warm)

    def _replay(self, bs: int, ctx: int, q: int) -> Captured:
        got = self.graphs[(bs, ctx, q)]
        got.graph.replay()
        return got

    def _replay_mtp(self, bs: int, ctx: int, q: int) -> torch.Tensor:
        got = self.graphs[(bs, ctx, q)]
        got.mtp_graph.replay()
        return got.drafts

    def _draft(
        self, bs: int, ctx: int, q: int, live: np.ndarray, next_ids: list[int], rows: list[int]
    ) -> torch.Tensor:
        """The MTP drafts [len(rows), k] of `rows` (live rows, one per request at most), live
        row t reading token next_ids[t], from the MTP graph of the step's key (`live`: its rows'
        graph rows)."""
        nxt = np.zeros(bs * q, dtype=np.int64)
        nxt[live] = next_ids
        at = np.zeros(bs, dtype=np.int64)
        at[: len(rows)] = live[rows]
        st = self.stage
        st.put("next_ids", nxt)
        st.put("draft_rows", at)
        st.put("draft_valid", np.arange(bs) < len(rows))
        st.send("next_ids", "draft_valid")
        return self._replay_mtp(bs, ctx, q)[: len(rows)]

    def _load(self, step: Dsv4Step, bs: int, q: int, ctx: int) -> np.ndarray:
        """The step into the static buffers of (bs, q, ctx): request b's tokens in rows b*q ..,
        then its filler rows; requests past the step's are padding (q tokens each). Returns the
        graph row of each of the step's rows."""
        b, n = len(step.counts), self._num_seqs(bs, q)
        counts = np.full(bs, q, dtype=np.int64)
        counts[:b] = step.counts
        starts = np.zeros(bs, dtype=np.int64)
        starts[:b] = step.starts
        req = np.repeat(np.arange(bs), q)
        j = np.tile(np.arange(q), bs)
        own = j < counts[req]  # the request's own rows; the others its filler sequence's
        pos = np.where(own, starts[req] + j, j - counts[req])
        live = np.flatnonzero(own & (req < b))
        ids = np.zeros(bs * q, dtype=np.int64)
        ids[live] = step.ids
        first = np.arange(bs) * q
        seq_start = np.zeros(n, dtype=np.int64)
        seq_start[:bs] = starts
        seq_end = np.concatenate((starts + counts, q - counts))[:n]
        tok_base = np.concatenate((first, first + counts))[:n]
        seq = np.where(own, req, bs + req)
        slots = np.zeros(n, dtype=np.int64)
        slots[:b] = step.slots
        width = ctx // self.runner.page_size
        table = np.zeros((n, width), dtype=np.int64)
        for i, p in enumerate(step.pages):
            table[i, : min(len(p), width)] = p[:width]
        st = self.stage
        for name, v in (("input_ids", ids), ("positions", pos), ("seq", seq), ("slots", slots),
                        ("chunk_start", seq_start), ("chunk_end", seq_end),
                        ("tok_base", tok_base), ("page_table", table)):  # fmt: skip
            st.put(name, v)
        for r in self.runner.ratios:
            closing = own & (req < b) & ((pos + 1) % r == 0)
            st.put(f"valid{r}", closing)
            st.put(f"keep{r}", keeps_prev(closing, pos, seq_end[seq], r))
        st.send("input_ids", "page_table", n * width)
        return live
