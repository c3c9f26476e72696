"""DeepSeek-V4's fast path compiles its fused glue and its Triton kernels before the engine
reports ready (models/deepseek_v4/warm_up.py): the first live requests, of lengths and batch
sizes the warm-up never ran (token counts of each class Triton would specialise: 1, multiples of
16, others; a prompt after a prefix hit), compile nothing (dynamo's compiled-graph counter and
the Triton kernels' variants stand still) and still equal the reference path."""

from __future__ import annotations

import sys

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
    lengths = (2, 37, 150, 301, 48, 64)
    prompts = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]
    prompts.append(prompts[2] + prompts[1][:23])  # a prefix hit, then 23 new tokens
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = [generate(engine, prompts[:-1], p), generate(engine, prompts[-1:], p)]
    outs = outs[0] + outs[1]
    return [[t for o in r for t in o.token_ids] for r in outs], [
        [lp for o in r for lp in o.logprobs or []] for r in outs
    ]


def _triton_kernels() -> list:
    from triton.runtime.jit import JITFunction

    mods = [m for n, m in list(sys.modules.items()) if n.startswith("kvrelay.kernels.") and m]
    return [f for m in mods for f in vars(m).values() if isinstance(f, JITFunction)]


def _triton_variants() -> dict[str, int]:
    """Per Triton kernel of kvrelay.kernels, its variants compiled (or loaded from Triton's disk
    cache) in this process: each new specialisation or config adds one."""
    return {
        f"{f.fn.__module__}.{f.fn.__name__}": sum(len(c[0]) for c in f.device_caches.values())
        for f in _triton_kernels()
    }


def test_first_requests_after_start_compile_nothing():
    torch._dynamo.reset()  # earlier tests' compiled variants must not stand in for the warm-up
    for f in _triton_kernels():  # nor their Triton variants (reloaded from disk when used)
        f.device_caches.clear()
    fast = _engine("triton", expert_format="nvfp4")
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0, "the warm-up compiled nothing: is the fused glue still in use?"
    variants = _triton_variants()
    assert sum(variants.values()) > 0, "no Triton kernel seen: has the kernels' layout changed?"
    got = _first_requests(fast)
    assert counters["stats"]["unique_graphs"] == compiled, "a live step compiled"
    after = _triton_variants()
    grew = {k: (variants.get(k, 0), n) for k, n in after.items() if n > variants.get(k, 0)}
    assert not grew, f"live steps compiled Triton variants (kernel: before, after): {grew}"
    want = _first_requests(_engine("reference", expert_format="nvfp4"))
    _same(got, want)
