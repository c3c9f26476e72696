"""DeepSeek-V4 over a batch of sequences whose caches live in paged pools.

Per-token work (embeddings, hyper-connections, norms, MoE, head) runs on all rows of the batch
at once; attention runs per sequence on the state it loads from the cache, through the same
`Attention` code as the full-sequence forward, so the engine computes what the oracle-checked
model computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvrelay.layers.step_profile import StepProfiler
from kvrelay.models.deepseek_v4.model import DeepseekV4ForCausalLM
from kvrelay.models.deepseek_v4.state import LayerState


@dataclass
class PagedSequence:
    rows: slice  # this sequence's rows in the batch
    start: int  # tokens already in the cache
    pages: torch.Tensor  # [num_pages] long, the request's page table
    slot: int  # its compressor-state slot


class PagedCache(Protocol):
    def load_layer(self, i: int, pages: torch.Tensor, slot: int, start: int) -> LayerState: ...

    def store_layer(
        self, i: int, pages: torch.Tensor, slot: int, start: int, n: int, new: LayerState
    ) -> None: ...


@torch.no_grad()
def forward_paged(
    model: DeepseekV4ForCausalLM,
    input_ids: torch.Tensor,
    seqs: list[PagedSequence],
    cache: PagedCache,
    sample_rows: torch.Tensor,
    on_layer: Callable[[int], None] | None = None,
    profile: StepProfiler | None = None,
    head: bool = True,
) -> torch.Tensor:
    """input_ids: [T], the sequences' new tokens back to back -> logits [len(sample_rows), V]
    (without `head`: those rows' final hidden states).
    `on_layer(i)` runs before layer i and once more after the last (benchmarks time layers);
    `profile` times attention (cache load/store included) and MoE of a profiled step."""
    m = model.model
    x = m.embed_tokens(input_ids)
    streams = x[:, None, :].expand(-1, m.config.hc_mult, -1).contiguous()
    for i, layer in enumerate(m.layers):

        def attend(xn: torch.Tensor, i: int = i, layer=layer) -> torch.Tensor:
            outs = []
            for s in seqs:
                state = cache.load_layer(i, s.pages, s.slot, s.start)
                out, new = layer.self_attn(xn[s.rows], s.start, state)
                cache.store_layer(i, s.pages, s.slot, s.start, out.shape[0], new)
                outs.append(out)
            return torch.cat(outs)

        if on_layer is not None:
            on_layer(i)
        streams = layer.run(streams, input_ids, attend, profile)
    if on_layer is not None:
        on_layer(len(m.layers))
    hidden = m.norm(m.hc_head(streams[sample_rows]))
    return model.compute_logits(hidden) if head else hidden
