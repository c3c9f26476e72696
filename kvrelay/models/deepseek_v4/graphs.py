"""CUDA graphs for DeepSeek-V4 decode: one graph per (batch bucket, context bucket), captured
on first use. The context bucket fixes how many compressed entries a step may address and the
page-table width, so a short context does not pay for the longest one.

Capture runs on padding only (every row in the dummy page 0 and state slot 0), then the live
batch is copied into the static buffers and replayed: a warm-up on live rows would apply the
step twice (the compressors' state update is not idempotent).
"""

from __future__ import annotations

import torch

from kvrelay.models.base import BUCKETS
from kvrelay.models.deepseek_v4.batch_meta import BatchMeta, Closers
from kvrelay.models.deepseek_v4.batched import forward_batched
from kvrelay.models.deepseek_v4.step import Dsv4Step

MIN_CONTEXT = 512


def context_bucket(tokens: int, page_size: int) -> int:
    """Power of two >= tokens (at least MIN_CONTEXT), a multiple of the page size."""
    c = MIN_CONTEXT
    while c < tokens:
        c *= 2
    return -(-c // page_size) * page_size


class Dsv4GraphRunner:
    def __init__(self, runner, max_bs: int, max_context: int) -> None:
        # runner: the family's side of the runner contract (runnable.DeepseekV4Runnable)
        self.runner = runner
        self.buckets = [b for b in BUCKETS if b <= max_bs]
        self.max_bs = self.buckets[-1]
        self.max_context = context_bucket(max_context, runner.page_size)
        self.min_context = min(context_bucket(1, runner.page_size), self.max_context)
        n, dev = self.max_bs, runner.device
        max_pages = self.max_context // runner.page_size

        def buf(*shape: int, dtype=torch.long) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=dev)

        self.input_ids, self.positions = buf(n), buf(n)
        self.page_table, self.slots = buf(n, max_pages), buf(n)
        self.chunk_start, self.chunk_end = buf(n), buf(n)
        self.rows = torch.arange(n, device=dev)
        self.valid = {r: buf(n, dtype=torch.bool) for r in runner.ratios}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def fits(self, context: int, batch_size: int) -> bool:
        return batch_size <= self.max_bs and context <= self.max_context

    def can_run(self, step: Dsv4Step, profile) -> bool:
        """A decode step (one sampled token per request) that a captured graph covers; profiled
        steps run eagerly so their components can be timed."""
        return (
            profile is None
            and not step.all_rows
            and all(c == 1 for c in step.counts)
            and step.n_sampled == len(step.counts) == len(step.rows)
            and self.fits(max(step.starts) + 1, len(step.counts))
        )

    def run(self, step: Dsv4Step, profile=None) -> torch.Tensor:
        """Float32 logits of the step's decode tokens, from the graph of its buckets."""
        return self.run_lists(step.ids, step.starts, step.pages, step.slots).float()

    def _meta(self, bs: int, ctx: int) -> BatchMeta:
        ps = self.runner.page_size
        closers = {
            r: Closers(self.rows[:bs], v[:bs], v[:bs]) for r, v in self.valid.items()
        }  # one token per row: a valid closer is its sequence's last
        return BatchMeta(
            positions=self.positions[:bs],
            seq=self.rows[:bs],
            page_table=self.page_table[:bs, : ctx // ps],
            slots=self.slots[:bs],
            chunk_start=self.chunk_start[:bs],
            chunk_end=self.chunk_end[:bs],
            tok_base=self.rows[:bs],
            closers=closers,
            max_entries={r: ctx // r for r in self.valid},
            page_size=ps,
        )

    def _forward(self, bs: int, ctx: int) -> torch.Tensor:
        r = self.runner
        return forward_batched(
            r.model, self.input_ids[:bs], self._meta(bs, ctx), r.cache, self.rows[:bs],
            r.ops, r.kernels,
        )  # fmt: skip

    def _pad(self, lo: int, hi: int) -> None:
        """Rows lo..hi-1 become padding: token 0 at position 0 in page 0, state slot 0."""
        for t in (self.input_ids, self.positions, self.slots, self.chunk_start):
            t[lo:hi].zero_()
        self.chunk_end[lo:hi].fill_(1)
        self.page_table[lo:hi].zero_()
        for v in self.valid.values():
            v[lo:hi].zero_()

    def capture(self, bs: int, ctx: int) -> None:
        """The graph of (batch bucket, context bucket), unless it is there already."""
        if (bs, ctx) in self.graphs:
            return
        self._pad(0, bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(bs, ctx)  # warm-up: Triton compiles, cuBLAS picks kernels
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call on another thread (a PD transfer opening an IPC handle, a
        # leftover engine) must not invalidate this capture; this thread's calls are still checked.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._forward(bs, ctx)
        self.pool = graph.pool()
        self.graphs[(bs, ctx)] = (graph, out)

    def run_lists(
        self,
        input_ids: list[int],
        starts: list[int],
        pages: list[list[int]],
        slots: list[int],
    ) -> torch.Tensor:
        """One decode token per sequence (token input_ids[b] at position starts[b]) -> logits."""
        b = len(input_ids)
        bs = next(x for x in self.buckets if x >= b)
        ctx = context_bucket(max(starts) + 1, self.runner.page_size)
        self.capture(bs, ctx)
        self._load(input_ids, starts, pages, slots, ctx)
        self._pad(b, bs)
        return self._replay(bs, ctx)[:b]

    def _replay(self, bs: int, ctx: int) -> torch.Tensor:
        graph, out = self.graphs[(bs, ctx)]
        graph.replay()
        return out

    def _load(self, input_ids, starts, pages, slots, ctx: int) -> None:
        """The live batch into rows 0..b-1 of the static buffers."""
        b, dev = len(input_ids), self.runner.device
        width = ctx // self.runner.page_size
        table = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(pages):
            table[i, : len(p)] = torch.tensor(p[:width], dtype=torch.long)
        st = torch.tensor(starts, dtype=torch.long)
        self.input_ids[:b].copy_(torch.tensor(input_ids, dtype=torch.long).to(dev))
        self.positions[:b].copy_(st.to(dev))
        self.chunk_start[:b].copy_(self.positions[:b])
        torch.add(self.positions[:b], 1, out=self.chunk_end[:b])
        self.slots[:b].copy_(torch.tensor(slots, dtype=torch.long).to(dev))
        self.page_table[:b, :width].copy_(table.to(dev))
        for r, v in self.valid.items():
            v[:b].copy_(((st + 1) % r == 0).to(dev))
