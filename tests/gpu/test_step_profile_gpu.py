"""The per-component step split on CUDA: events around attention and MLP/MoE, profiled steps run
eagerly between graph-replayed ones, and the tokens do not change (float32: the graph and the
eager path round alike up to GEMM shape choices; greedy tokens must agree)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine
from kvrelay.engine.messages import AddRequest, SamplingParams

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)


def _engine(model: str, every: int) -> Engine:
    return Engine(
        EngineConfig(
            model=model,
            load_format="dummy",
            dtype="float32",
            step_profile_every=every,
            cache=CacheConfig(max_total_tokens=8192),
            scheduler=SchedulerConfig(max_num_batched_tokens=512),
        )
    )


def _run(engine: Engine, vocab: int):
    g = torch.Generator().manual_seed(5)
    for i, n in enumerate([3, 40, 130, 700]):
        engine.add(AddRequest(f"r{i}", torch.randint(1, vocab, (n,), generator=g).tolist(), PARAMS))
    stats, outs = [], {}
    while engine.has_work:
        step = engine.step()
        if step.stats.batch_size:
            stats.append(step.stats)
        for o in step.outputs:
            toks, lps = outs.setdefault(o.rid, ([], []))
            toks += o.token_ids
            lps += o.logprobs or []
    return stats, outs


def _check(stats, parts: set[str]) -> None:
    split = [s for s in stats if s.components is not None]
    assert split and len(split) == sum(1 for i in range(len(stats)) if (i + 1) % 2 == 0)
    for s in split:
        c = s.components
        assert set(c) == parts | {"communication", "other"}
        assert all(c[p] > 0 for p in parts)
        assert sum(c[p] for p in parts) <= s.step_ms  # GPU time of the regions, inside the step


def test_dense_profiled_steps_skip_graphs_and_keep_tokens():
    plain = _engine("smollm2-135m", 0)
    vocab = plain.src.config.vocab_size
    _, want = _run(plain, vocab)
    e = _engine("smollm2-135m", 2)
    assert e.runner.graphs is not None
    replays = []
    graphed = e.runner.graphs.run
    e.runner.graphs.run = lambda fb: replays.append(1) or graphed(fb)
    stats, got = _run(e, vocab)
    _check(stats, {"attention", "mlp"})
    decode_steps = [s for s in stats if not s.num_prefill]
    assert len(replays) == sum(1 for s in decode_steps if s.components is None)
    assert len(replays) > 0
    for rid, (toks, lps) in want.items():
        assert got[rid][0] == toks, rid
        assert got[rid][1] == pytest.approx(lps, abs=1e-4), rid


def test_deepseek_v4_split_names_moe():
    e = _engine("dsv4-tiny", 2)
    stats, outs = _run(e, 250)
    assert all(len(t) == PARAMS.max_tokens for t, _ in outs.values())
    _check(stats, {"attention", "moe"})
