"""The DeepSeek-V4 graph runner's buffers, buckets and padding with 'replay' = an eager forward
on the static buffers (CPU has no CUDA graphs): what a captured graph would compute."""

from __future__ import annotations

import torch

from kvrelay.models.deepseek_v4.graphs import Captured, Dsv4GraphRunner


class EagerGraphs(Dsv4GraphRunner):
    def capture(self, bs: int, ctx: int, q: int = 1) -> None:
        """The warm-up a real capture runs first (eagerly, on padding), no graph."""
        if (bs, ctx, q) in self.graphs:
            return
        self._warm_up(bs, ctx, q)
        self.graphs[(bs, ctx, q)] = None

    def _replay(self, bs: int, ctx: int, q: int) -> Captured:
        got = self._forward(bs, ctx, q)
        self.graphs[(bs, ctx, q)] = got  # the MTP pass reads its streams, meta and index
        return got

    def _replay_mtp(self, bs: int, ctx: int, q: int) -> torch.Tensor:
        return self._mtp_forward(bs, q, self.graphs[(bs, ctx, q)])


def use_eager_graphs(engine, max_bs: int = 8) -> EagerGraphs:
    """Give `engine` (a DeepSeek-V4 engine on the CPU) an eager graph runner, as make_graphs
    would on the GPU (verify steps of up to 1 + num_draft_tokens tokens per request)."""
    family = engine.runner.family
    spec = engine.cfg.speculative
    max_q = 1 if spec.algorithm == "none" else 1 + spec.num_draft_tokens
    engine.runner.graphs = EagerGraphs(family, max_bs, engine.runner.max_model_len, max_q)
    return engine.runner.graphs
