"""The graph runners' buffers, buckets and padding with 'replay' = an eager forward on the
static buffers (CPU has no CUDA graphs): what a captured graph would compute. DeepSeek-V4's
and the dense one's."""

from __future__ import annotations

import torch

from kvrelay.cache.paging import pages_for
from kvrelay.models.deepseek_v4.graphs import Captured, Dsv4GraphRunner
from kvrelay.models.llama.graphs import CudaGraphRunner


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
    family, max_q = engine.runner.family, engine.cfg.speculative.rows_per_request
    engine.runner.graphs = EagerGraphs(family, max_bs, engine.runner.max_model_len, max_q)
    return engine.runner.graphs


class EagerDenseGraphs(CudaGraphRunner):
    """The dense graph runner with 'replay' = an eager forward on its static buffers."""

    def _warm_up(self, bs: int, q: int) -> None:
        pass

    def _capture(self, bs: int, q: int, profile):
        return None, None

    def _replay(self, bs: int, q: int) -> torch.Tensor:
        return self._forward(bs, q, None)


def use_eager_dense_graphs(engine, max_bs: int = 8) -> EagerDenseGraphs:
    """Give a dense engine on the CPU the graph runner make_graphs would build on the GPU."""
    family = engine.runner.family
    engine.runner.graphs = EagerDenseGraphs(
        family.model, family.pool.layers, family.backend, family.ops, max_bs,
        pages_for(engine.runner.max_model_len, family.page_size), engine.runner.device,
        max_q=engine.cfg.speculative.rows_per_request, page_size=family.page_size,
    )  # fmt: skip
    return engine.runner.graphs
