"""Dense verify steps in CUDA graphs (models/llama/graphs.py) on the GPU: SmolLM2-135M (dummy
weights, float32, Triton kernels) with n-gram drafts replays one verify graph of 1 + K rows per
request per bucket, and greedy tokens equal the plain graphed engine's except at a genuine
near-tie of the plain run (top-2 logprob gap below 1e-3: verify rows go through the varlen
attention kernel, decode rows through the split-K decode kernel, so rounding differs)."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, SpeculativeConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

pytestmark = pytest.mark.gpu

CFG = EngineConfig(
    model="smollm2-135m",
    load_format="dummy",
    dtype="float32",
    cuda_graphs=True,
    cache=CacheConfig(max_total_tokens=16384),
)


def _run(engine, prompts):
    p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)
    outs = generate(engine, prompts, p)
    engine.check_idle_integrity()
    toks = [[t for o in r for t in o.token_ids] for r in outs]
    tops = [[o.top_logprobs[0] for o in r] for r in outs]
    return toks, tops


@pytest.mark.parametrize("n", [1, 5])
def test_verify_graphs_equal_plain_graphs(n):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 49152, (24,), generator=g).tolist() * 3 for _ in range(n)]
    plain = Engine(CFG)
    want, tops = _run(plain, prompts)
    spec = Engine(dataclasses.replace(CFG, speculative=SpeculativeConfig("ngram", 4)), plain.src)
    graphs = spec.runner.graphs
    assert (graphs.buckets[0], 5) in graphs.graphs  # verify graphs captured at start
    replays, replay = collections.Counter(), graphs._replay
    graphs._replay = lambda bs, q: replays.update([q]) or replay(bs, q)
    got, _ = _run(spec, prompts)
    assert replays[5] > 0, dict(replays)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        j = next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if j is not None:
            gap = tops[i][j][0].logprob - tops[i][j][1].logprob
            assert gap < 1e-3, f"prompt {i}: first divergence at token {j}, top-2 gap {gap}"
