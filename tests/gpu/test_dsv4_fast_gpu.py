"""DeepSeek-V4's fast path on the GPU (batched forward, Triton kernels, decode CUDA graphs)
against the per-sequence torch reference path, in float32: the same greedy tokens on 8 prompts
x 64 tokens, logprobs within 1e-4; graph replay equals the same kernels run eagerly. Dense
experts' fast path against the reference path is in the quick tier through
test_dsv4_prefix_gpu.py (cache off and on), so [dense] here is gpu_full."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiered

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.weights.loader import resolve

pytestmark = pytest.mark.gpu


def _engine(backend: str, graphs: bool = True, expert_format: str = "dense", qat=False):
    src = resolve("dsv4-tiny", "dummy")
    c = src.config.with_(qat_simulation=qat, expert_format=expert_format)
    cfg = EngineConfig(
        model="dsv4-tiny",
        load_format="dummy",
        device="cuda",
        dtype="float32",
        attention_backend=backend,
        cuda_graphs=graphs,
        cache=CacheConfig(max_total_tokens=16384),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )
    return Engine(cfg, dataclasses.replace(src, config=c))


def _run(engine: Engine, n: int = 64):
    g = torch.Generator().manual_seed(11)
    vocab = engine.runner.model_cfg.vocab_size
    prompts = [
        torch.randint(0, vocab, (k,), generator=g).tolist()
        for k in (1, 5, 16, 17, 40, 99, 150, 300)
    ]
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = generate(engine, prompts, p)
    toks = [[t for o in r for t in o.token_ids] for r in outs]
    lps = [[lp for o in r for lp in o.logprobs or []] for r in outs]
    return toks, lps


def _same(a, b, tol: float = 1e-4) -> None:
    assert a[0] == b[0]
    delta = max(
        abs(x - y) for r1, r2 in zip(a[1], b[1], strict=True) for x, y in zip(r1, r2, strict=True)
    )
    assert delta < tol


@tiered("expert_format", ["dense", "nvfp4"], quick=["nvfp4"])
def test_fast_path_equals_reference_path(expert_format: str) -> None:
    ref = _engine("reference", expert_format=expert_format)
    want = _run(ref)
    del ref
    fast = _engine("triton", expert_format=expert_format)
    assert fast.runner.graphs is not None
    got = _run(fast)
    assert fast.runner.graphs.graphs, "decode steps should have replayed graphs"
    _same(got, want)
    fast.check_idle_integrity()


def test_graph_replay_equals_eager_kernels() -> None:
    eager = _run(_engine("triton", graphs=False), n=32)
    graphed = _run(_engine("triton", graphs=True), n=32)
    _same(graphed, eager, tol=1e-5)
