"""Dense CUDA graphs over batch-size buckets: decode graphs (one token per request) and, when
speculating, verify graphs of `max_q` rows per request. Padded rows write to the dummy page 0.

A verify graph's layout: request b's n_b tokens fill rows b*q .. b*q + n_b - 1 and its sequence
length grows by q - n_b, so row i keeps its position (seq_len - q + i in the varlen kernel); the
q - n_b rows after its tokens are padding: their K/V go to slot 0 of the dummy page and their
outputs are never read. The real rows come first, so causal attention never shows them the
padding. One graph per bucket covers any mix of counts <= q (drafts of different lengths, short
prompt chunks)."""

from __future__ import annotations

import torch

from kvrelay.layers.attention import AttentionMetadata
from kvrelay.layers.step_profile import StepProfiler
from kvrelay.models.base import BUCKETS
from kvrelay.models.llama.model import ForwardContext
from kvrelay.models.llama.step import ForwardBatch


class CudaGraphRunner:
    """One decode graph per batch-size bucket (and a verify graph per bucket when `max_q` > 1);
    with step profiling, a second decode variant per bucket whose attention/MLP regions are
    event-record nodes (captured at start when profiling is on then, else on the first profiled
    step of the bucket, which that step skips)."""

    def __init__(
        self,
        model,
        kv_layers,
        backend,
        ops,
        max_bs: int,
        max_pages: int,
        device,
        profiled: bool = False,
        max_q: int = 1,
        page_size: int = 16,
    ) -> None:
        self.model, self.kv_layers, self.backend, self.ops = model, kv_layers, backend, ops
        self.device, self.max_q, self.max_pages = device, max_q, max_pages
        self.buckets = [b for b in BUCKETS if b <= max_bs]
        self.max_bs = self.buckets[-1]
        n = self.max_bs * max_q
        i32 = {"dtype": torch.int32, "device": device}
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(self.max_bs, **i32)
        # Columns past max_pages stay 0: a padding row's position may run q - 1 past its
        # request's last page, and the kernel looks each position up in the table.
        extra = -(-(max_q - 1) // page_size)
        self.page_table = torch.zeros((self.max_bs, max_pages + extra), **i32)
        self.cu = {q: torch.arange(self.max_bs + 1, **i32) * q for q in {1, max_q}}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # bucket -> (graph, logits, the regions captured in it)
        self.profiled: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, StepProfiler]] = {}
        self.pool = None
        for bs in reversed(self.buckets):
            for q in sorted({1, max_q}):
                self._warm_up(bs, q)
                self.graphs[(bs, q)] = self._capture(bs, q, None)
            if profiled:
                self._capture_profiled(bs)
        if device.type == "cuda":
            torch.cuda.synchronize()

    def _forward(self, bs: int, q: int, profile: StepProfiler | None) -> torch.Tensor:
        rows = bs * q
        attn = AttentionMetadata(
            self.slots[:rows], self.page_table[:bs], self.seq_lens[:bs], self.cu[q][: bs + 1],
            q, q == 1,
        )  # fmt: skip
        ctx = ForwardContext(attn, self.kv_layers, self.backend, self.ops, profile)
        hidden = self.model(self.input_ids[:rows], self.positions[:rows], ctx)
        return self.model.compute_logits(hidden)

    def _warm_up(self, bs: int, q: int) -> None:
        """One eager forward before capture: Triton compiles, cuBLAS picks kernels. On padding
        (every row in the dummy page), each sequence as long as its rows."""
        self.seq_lens[:bs].fill_(q)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(bs, q, None)
        torch.cuda.current_stream().wait_stream(stream)

    def _capture(self, bs: int, q: int, profile: StepProfiler | None):
        """Capture only: nothing runs, so the buffers may hold a live batch's rows."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call on another thread (a PD transfer opening an IPC handle, a
        # leftover engine) must not invalidate this capture; this thread's calls are still checked.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._forward(bs, q, profile)
        self.pool = graph.pool()
        return graph, out

    def _replay(self, bs: int, q: int) -> torch.Tensor:
        graph, out = self.graphs[(bs, q)]
        graph.replay()
        return out

    def _capture_profiled(self, bs: int) -> None:
        regions = StepProfiler(self.device, in_graph=True)
        self.profiled[bs] = (*self._capture(bs, 1, regions), regions)

    def can_run(self, fb: ForwardBatch, profile: StepProfiler | None = None) -> bool:
        fits = fb.batch_size <= self.max_bs and fb.attn.page_table.shape[1] <= self.max_pages
        if fb.is_decode:
            return fits
        # A verify step (or prompt chunks as short): no prompt logprobs, no profile regions.
        return (
            fits
            and self.max_q > 1
            and fb.attn.max_q_len <= self.max_q
            and fb.prompt_rows is None
            and profile is None
        )

    def run(self, fb: ForwardBatch, profile: StepProfiler | None = None) -> torch.Tensor:
        b = fb.batch_size
        bs = next(x for x in self.buckets if x >= b)
        w = fb.attn.page_table.shape[1]
        self.page_table[:b, :w].copy_(fb.attn.page_table)
        if bs > b:  # padding requests: token 0 at position 0 in the dummy page
            self.page_table[b:bs].zero_()
        if not fb.is_decode:
            return self._run_verify(fb, b, bs)
        self.input_ids[:b].copy_(fb.input_ids)
        self.positions[:b].copy_(fb.positions)
        self.slots[:b].copy_(fb.attn.slot_mapping)
        self.seq_lens[:b].copy_(fb.attn.seq_lens)
        if bs > b:  # one token of context each
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.slots[b:bs].zero_()
            self.seq_lens[b:bs].fill_(1)
        if profile is not None and bs not in self.profiled:
            self._capture_profiled(bs)  # its time would land in this step: not reported
            profile.skipped = True
        if profile is None or profile.skipped:
            return self._replay(bs, 1)[:b]
        graph, out, regions = self.profiled[bs]
        profile.replayed(regions)
        graph.replay()
        return out[:b]

    def _run_verify(self, fb: ForwardBatch, b: int, bs: int) -> torch.Tensor:
        """The packed rows scattered into q rows per request, on the device (no host sync)."""
        q, rows = self.max_q, bs * self.max_q
        cu = fb.attn.cu_seqlens_q.long()
        packed = torch.arange(fb.input_ids.shape[0], device=cu.device)
        seq = torch.searchsorted(cu[1:], packed, right=True)
        dest = seq * q + packed - cu[seq]
        for buf in (self.input_ids, self.positions, self.slots):
            buf[:rows].zero_()
        self.input_ids.index_copy_(0, dest, fb.input_ids)
        self.positions.index_copy_(0, dest, fb.positions)
        self.slots.index_copy_(0, dest, fb.attn.slot_mapping)
        counts = (cu[1:] - cu[:-1]).to(torch.int32)
        self.seq_lens[:b].copy_(fb.attn.seq_lens + (q - counts))
        self.seq_lens[b:bs].fill_(q)  # padding requests: q tokens from position 0, page 0
        return self._replay(bs, q)[dest[fb.sample_rows]]
