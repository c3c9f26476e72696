"""DeepSeek-V4's fast path compiles its fused glue before the engine reports ready
(models/deepseek_v4/warm_up.py): the first live requests, of lengths and batch sizes the warm-up never
ran, compile nothing (dynamo's compiled-graph counter stands still) and still equal the
reference path."""

from __future__ import annotations

import pytest
import torch
from test_dsv4_fast_gpu import _engine, _same
from torch._dynamo.utils import counters

from kvrelay.engine.engine import generate
from kvrelay.engine.messages import SamplingParams

pytestmark = pytest.mark.gpu


def _first_requests(engine):
    g = torch.Generator().manual_seed(5)
    vocab = engine.runner.model_cfg.vocab_size
    prompts = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in (2, 37, 150, 301)]
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = generate(engine, prompts, p)
    return [[t for o in r for t in o.token_ids] for r in outs], [
        [lp for o in r for lp in o.logprobs or []] for r in outs
    ]


def test_first_requests_after_start_compile_nothing():
    torch._dynamo.reset()  # earlier tests' compiled variants must not stand in for the warm-up
    fast = _engine("triton", expert_format="nvfp4")
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0, "the warm-up compiled nothing: is the fused glue still in use?"
    got = _first_requests(fast)
    assert counters["stats"]["unique_graphs"] == compiled, "a live step compiled"
    want = _first_requests(_engine("reference", expert_format="nvfp4"))
    _same(got, want)
