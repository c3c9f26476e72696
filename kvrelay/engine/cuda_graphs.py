"""Decode CUDA graphs over batch-size buckets; padded rows write to the dummy page 0."""

from __future__ import annotations

import torch

from kvrelay.engine.batch import ForwardBatch
from kvrelay.layers.attention import AttentionMetadata
from kvrelay.models.llama import ForwardContext

BUCKETS = (
    1,
    2,
    4,
    8,
    12,
    16,
    24,
    32,
    40,
    48,
    56,
    64,
    80,
    96,
    112,
    128,
    160,
    192,
    224,
    256,
    320,
    384,
    448,
    512,
)


class CudaGraphRunner:
    def __init__(self, model, kv_layers, backend, ops, max_bs: int, max_pages: int, device) -> None:
        self.model = model
        self.buckets = [b for b in BUCKETS if b <= max_bs]
        self.max_bs = self.buckets[-1]
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.page_table = torch.zeros((n, max_pages), dtype=torch.int32, device=device)
        self.cu = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        for bs in reversed(self.buckets):
            ctx = ForwardContext(
                AttentionMetadata(
                    self.slots[:bs],
                    self.page_table[:bs],
                    self.seq_lens[:bs],
                    self.cu[: bs + 1],
                    1,
                    True,
                ),
                kv_layers,
                backend,
                ops,
            )
            run = (
                lambda bs=bs, ctx=ctx: model.compute_logits(  # noqa: E731
                    model(self.input_ids[:bs], self.positions[:bs], ctx)
                )
            )
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run()  # warm-up: Triton compiles and cuBLAS picks its kernels outside capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = run()
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, fb: ForwardBatch) -> bool:
        return (
            fb.is_decode
            and fb.batch_size <= self.max_bs
            and fb.attn.page_table.shape[1] <= self.page_table.shape[1]
        )

    def run(self, fb: ForwardBatch) -> torch.Tensor:
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
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
