"""The per-component step split on CUDA: events around attention and MLP/MoE; graphed decode
steps replay a variant of their graph whose regions are event-record nodes (captured at start, or
on first use when profiling is switched on later); the tokens do not change. Quick tier: the
dense profiled decode; gpu_full: switching it on later, and DeepSeek-V4's split (its graphed fast
path is in the quick tier through test_capture_isolation.py and test_dsv4_fast_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)


def _engine(model: str, every: int) -> Engine:
    return Engine(
        EngineConfig(
            model=model,
            load_format="dummy",
            dtype="float32",
            step_profile_every=every,
            # Decode batches here are <= 4: graphs for buckets 1, 2 and 4 (not all 20 up to
            # 256, each captured twice when profiling is on at start) cover every replay.
            max_cuda_graph_batch=4,
            cache=CacheConfig(max_total_tokens=8192),
            scheduler=SchedulerConfig(max_num_batched_tokens=512),
        )
    )


def outputs(outs) -> tuple[list[int], list[float]]:
    return [t for o in outs for t in o.token_ids], [x for o in outs for x in o.logprobs or []]


def _run(engine: Engine, vocab: int):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in [3, 40, 130, 700]]
    stats = []
    outs = generate(engine, prompts, PARAMS, stats)
    return stats, [outputs(o) for o in outs]


def _check(stats, parts: set[str], profiled: list[bool]) -> None:
    assert [s.components is not None for s in stats] == profiled
    for s in stats:
        c = s.components
        if c is None:
            continue
        assert set(c) == parts | {"communication", "other"}
        assert all(c[p] > 0 for p in parts)
        assert sum(c[p] for p in parts) < s.step_ms  # GPU time of the regions, inside the step


def _same_outputs(got, want) -> None:
    for i, ((toks, lps), (want_toks, want_lps)) in enumerate(zip(got, want, strict=True)):
        assert toks == want_toks, i
        assert lps == pytest.approx(want_lps, abs=1e-4), i


@pytest.fixture(scope="module")
def plain():
    e = _engine("smollm2-135m", 0)
    return _run(e, e.src.config.vocab_size)[1]


def _count_graph_runs(e: Engine) -> list[bool]:
    """Wraps the runner's graph replays; the list says, per replay, whether it was profiled."""
    runs: list[bool] = []
    graphed = e.runner.graphs.run
    e.runner.graphs.run = lambda fb, profile=None: (
        runs.append(profile is not None) or graphed(fb, profile)
    )
    return runs


def test_dense_profiled_decode_steps_replay_timed_graphs(plain):
    e = _engine("smollm2-135m", 2)
    assert set(e.runner.graphs.profiled) == set(e.runner.graphs.buckets)  # captured at start
    runs = _count_graph_runs(e)
    stats, got = _run(e, e.src.config.vocab_size)
    _check(stats, {"attention", "mlp"}, [(i + 1) % 2 == 0 for i in range(len(stats))])
    decode = [s for s in stats if not s.num_prefill]
    assert runs == [s.components is not None for s in decode]  # every decode step replayed
    assert any(runs)
    _same_outputs(got, plain)


@pytest.mark.gpu_full
def test_switched_on_later_captures_on_first_use(plain):
    e = _engine("smollm2-135m", 0)
    assert not e.runner.graphs.profiled
    runs = _count_graph_runs(e)
    e.profile_every = 1  # what POST /telemetry/profile does
    stats, got = _run(e, e.src.config.vocab_size)
    # A bucket's first profiled step captures its timed variant: that step is not reported.
    first = {}
    for i, s in enumerate(stats):
        if not s.num_prefill:
            first.setdefault(next(b for b in e.runner.graphs.buckets if b >= s.batch_size), i)
    _check(stats, {"attention", "mlp"}, [i not in first.values() for i in range(len(stats))])
    assert set(e.runner.graphs.profiled) == set(first) and all(runs)
    _same_outputs(got, plain)


@pytest.mark.gpu_full
def test_deepseek_v4_split_names_moe():
    e = _engine("dsv4-tiny", 2)
    stats, outs = _run(e, 250)
    assert all(len(t) == PARAMS.max_tokens for t, _ in outs)
    _check(stats, {"attention", "moe"}, [(i + 1) % 2 == 0 for i in range(len(stats))])
