"""Compile DeepSeek-V4's fast path before the engine reports ready.

The fused glue (models/deepseek_v4/fusion.py) compiles on first use: on the H200 the first
prefill step of a fresh server spent ~30 s in torch.compile, long enough for a PD decode
server's reservations to expire behind it (127 transfer timeouts in the first burst). Here a few
steps on padding only run first: every sequence in the dummy page 0 and state slot 0, which no
request is ever handed, so no live state is touched. Shapes: one sequence (dynamo compiles it
static), then other token and sequence counts (it recompiles them dynamic, which later steps of
any size reuse), and a single token (sizes 0 and 1 are always specialised); the first two again
from a page in (a prompt's later chunk or one after a prefix cache hit: on the H100 the first
such step of a fresh engine cost ~0.85 s more, 2026-12-07, not yet pinned down); one step per
routed-expert tile config that the step's token budget reaches (each config is a Triton compile of
its own: a 200-token prompt on the agent paid ~0.5 s for one after the warm-up, 2026-12-07, H200)
and one past the mHC pre kernel's token limit;
then the decode graphs of the two smallest batch buckets (and their verify graphs with every
draft, speculating). The Triton kernels' token and context counts are not specialised
(kernels/triton_pointwise.py `_jit`), so no other count compiles anything new.
"""

from __future__ import annotations

import logging
import time

import torch

from kvrelay.cache.paging import pages_for
from kvrelay.kernels.triton_moe import default_config
from kvrelay.models.deepseek_v4.step import Dsv4Step

log = logging.getLogger("kvrelay.runner")


def warm_up_shapes(page_size: int, max_tokens: int) -> list[list[int]]:
    """New-token counts per sequence of each warm-up step, within the step's token budget."""
    first = min(page_size + 3, max_tokens - 1)  # the second's total differs from it
    shapes = [[first], [2, min(2 * page_size + 7, max_tokens - 2)], [1, 1, 1], [1]]
    return [c for c in shapes if min(c) >= 1 and sum(c) <= max_tokens]


def moe_config_token_counts(num_experts: int, top_k: int, max_tokens: int) -> list[int]:
    """The smallest token count of each routed-expert tile config (triton_moe.default_config)
    that a step of at most `max_tokens` tokens can pick."""
    counts, seen = [], set()
    for t in range(1, max_tokens + 1):
        cfg = default_config(t * top_k, num_experts)
        if cfg not in seen:
            seen.add(cfg)
            counts.append(t)
    return counts


def variant_token_counts(model_cfg, hc_pre_max_tokens: int, max_tokens: int) -> list[int]:
    """Step token counts that pick kernels of their own: one per routed-expert tile config, and
    the first past `hc_pre_max_tokens`, where the mHC pre side leaves the fused kernel for the
    gates kernel (never compiled by the shapes otherwise when the experts' configs all switch
    below it: the agent's first 576-token prompt step compiled it, 28.5 ms a token that run,
    H100, 2026-12-08)."""
    c = model_cfg
    counts = moe_config_token_counts(c.n_routed_experts, c.num_experts_per_tok, max_tokens)
    past_pre = hc_pre_max_tokens + 1
    if 1 < past_pre <= max_tokens and not any(t >= past_pre for t in counts):
        counts.append(past_pre)
    return counts


def padding_step(counts: list[int], page_size: int, start: int = 0) -> Dsv4Step:
    """Sequences of `counts` new tokens from position `start` (> 0: a prompt's later chunk, or
    a prompt after a prefix cache hit), all in page 0 and state slot 0."""
    ends = [sum(counts[: i + 1]) for i in range(len(counts))]
    return Dsv4Step(
        ids=[0] * ends[-1],
        starts=[start] * len(counts),
        counts=counts,
        pages=[[0] * pages_for(start + c, page_size) for c in counts],
        slots=[0] * len(counts),
        rows=[e - 1 for e in ends],
        n_sampled=len(counts),
    )


def warm_up_steps(page_size: int, max_tokens: int, moe_counts: list[int] = ()) -> list[Dsv4Step]:
    """The padding steps of the warm-up: each shape from position 0, then the first two again
    from a page in (chunks after earlier tokens take kernel variants of their own), then one
    step of each token count in `moe_counts` that no shape before it has."""
    shapes = warm_up_shapes(page_size, max_tokens)
    first = [padding_step(c, page_size) for c in shapes]
    steps = first + [padding_step(c, page_size, page_size) for c in shapes[:2]]
    had = {sum(c) for c in shapes}
    return steps + [padding_step([t], page_size) for t in moe_counts if t not in had]


@torch.inference_mode()
def warm_up(model, graphs) -> None:
    """Run the padding steps and capture the smallest decode graphs (the fast path on a GPU).
    `model`: the family's side of the runner contract (runnable.DeepseekV4Runnable)."""
    if model.device.type != "cuda" or model.kernels is None or model.tp.is_parallel:
        return
    t0 = time.monotonic()
    max_tokens = model.cfg.scheduler.max_num_batched_tokens
    counts = variant_token_counts(model.model_cfg, model.kernels.hc_pre_max_tokens, max_tokens)
    if model.cfg.deterministic:  # one MoE config and one mHC kernel at every token count
        counts = []
    steps = warm_up_steps(model.page_size, max_tokens, counts)
    for step in steps:
        model.forward(step, None)
    if graphs is not None:
        for bs in graphs.buckets[:2]:
            for q in sorted({1, graphs.max_q}):  # decode steps, and verify steps with every draft
                graphs.capture(bs, graphs.min_context, q)
    torch.cuda.synchronize()
    log.info("warm-up compiled steps=%d in %.1fs", len(steps), time.monotonic() - t0)
