"""Dense decode CUDA graphs over batch-size buckets; padded rows write to the dummy page 0."""

from __future__ import annotations

import torch

from kvrelay.layers.attention import AttentionMetadata
from kvrelay.layers.step_profile import StepProfiler
from kvrelay.models.base import BUCKETS
from kvrelay.models.llama.model import ForwardContext
from kvrelay.models.llama.step import ForwardBatch


class CudaGraphRunner:
    """One decode graph per batch-size bucket; with step profiling, a second variant per bucket
    whose attention/MLP regions are event-record nodes (captured at start when profiling is on
    then, else on the first profiled step of the bucket, which that step skips)."""

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
    ) -> None:
        self.model, self.kv_layers, self.backend, self.ops = model, kv_layers, backend, ops
        self.device = device
        self.buckets = [b for b in BUCKETS if b <= max_bs]
        self.max_bs = self.buckets[-1]
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.page_table = torch.zeros((n, max_pages), dtype=torch.int32, device=device)
        self.cu = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # bucket -> (graph, logits, the regions captured in it)
        self.profiled: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, StepProfiler]] = {}
        self.pool = None
        for bs in reversed(self.buckets):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(bs, None)  # warm-up: Triton compiles, cuBLAS picks kernels
            torch.cuda.current_stream().wait_stream(stream)
            self.graphs[bs] = self._capture(bs, None)
            if profiled:
                self._capture_profiled(bs)
        torch.cuda.synchronize()

    def _forward(self, bs: int, profile: StepProfiler | None) -> torch.Tensor:
        attn = AttentionMetadata(
            self.slots[:bs], self.page_table[:bs], self.seq_lens[:bs], self.cu[: bs + 1], 1, True
        )
        ctx = ForwardContext(attn, self.kv_layers, self.backend, self.ops, profile)
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], ctx)
        return self.model.compute_logits(hidden)

    def _capture(self, bs: int, profile: StepProfiler | None):
        """Capture only: nothing runs, so the buffers may hold a live batch's rows."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call on another thread (a PD transfer opening an IPC handle, a
        # leftover engine) must not invalidate this capture; this thread's calls are still checked.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._forward(bs, profile)
        self.pool = graph.pool()
        return graph, out

    def _capture_profiled(self, bs: int) -> None:
        regions = StepProfiler(self.device, in_graph=True)
        self.profiled[bs] = (*self._capture(bs, regions), regions)

    def can_run(self, fb: ForwardBatch, profile: StepProfiler | None = None) -> bool:
        return (
            fb.is_decode
            and fb.batch_size <= self.max_bs
            and fb.attn.page_table.shape[1] <= self.page_table.shape[1]
        )

    def run(self, fb: ForwardBatch, profile: StepProfiler | None = None) -> torch.Tensor:
        b = fb.batch_size
        bs = next(x for x in self.buckets if x >= b)
        self.input_ids[:b].copy_(fb.input_ids)
        self.positions[:b].copy_(fb.positions)
        self.slots[:b].copy_(fb.attn.slot_mapping)
        self.seq_lens[:b].copy_(fb.attn.seq_lens)
        w = fb.attn.page_table.shape[1]
        self.page_table[:b, :w].copy_(fb.attn.page_table)
        if bs > b:  # padding rows: token 0 at position 0, one token of context, in the dummy page
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.slots[b:bs].zero_()
            self.seq_lens[b:bs].fill_(1)
            self.page_table[b:bs].zero_()
        if profile is not None and bs not in self.profiled:
            self._capture_profiled(bs)  # its time would land in this step: not reported
            profile.skipped = True
        if profile is None or profile.skipped:
            graph, out = self.graphs[bs]
        else:
            graph, out, regions = self.profiled[bs]
            profile.replayed(regions)
        graph.replay()
        return out[:b]
