"""Per-component step profiling on CPU (wall clock; tests/gpu covers CUDA events and graphs):
the N-th steps carry a split whose parts are real and add up to the step, the model's
components are named (dense: attention + mlp, DeepSeek-V4: attention + moe), and profiling
changes no token or logprob."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.layers.step_profile import StepProfiler
from kvrelay.weights.loader import resolve

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)


def outputs(outs) -> tuple[list[int], list[float]]:
    """One request's tokens and chosen-token logprobs."""
    return [t for o in outs for t in o.token_ids], [x for o in outs for x in o.logprobs or []]


def run(engine: Engine, prompts: list[list[int]]) -> tuple[list, list]:
    """(every batch step's stats, every request's (tokens, logprobs)) for the prompts together."""
    stats = []
    outs = generate(engine, prompts, PARAMS, stats)
    return stats, [outputs(o) for o in outs]


def prompts(vocab: int, lengths=(9, 40, 75)) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def check_split(s, parts: set[str]) -> None:
    c = s.components
    assert set(c) == parts | {"communication", "other"}
    assert c["communication"] == 0.0  # one engine, nothing sent
    assert all(c[p] > 0 for p in parts)
    # The regions lie inside the step, and `other` is the rest of it.
    assert sum(c[p] for p in parts) <= s.step_ms
    assert sum(c.values()) == pytest.approx(s.step_ms, rel=1e-6)


@pytest.fixture(scope="module")
def smollm2():
    return resolve("smollm2")


def dense_engine(src, every: int) -> Engine:
    cfg = EngineConfig(
        device="cpu", step_profile_every=every, cache=CacheConfig(max_total_tokens=2048)
    )
    return Engine(cfg, src)


def test_dense_every_third_step_split_and_outputs_unchanged(smollm2):
    ids = prompts(smollm2.config.vocab_size)
    plain_stats, plain = run(dense_engine(smollm2, 0), ids)
    stats, profiled = run(dense_engine(smollm2, 3), ids)
    assert all(s.components is None for s in plain_stats)
    assert [s.components is not None for s in stats] == [
        (i + 1) % 3 == 0 for i in range(len(stats))
    ]
    for s in stats:
        if s.components is not None:
            check_split(s, {"attention", "mlp"})
    assert profiled == plain  # same tokens, bit-identical logprobs


def test_runtime_switch(smollm2):
    e = dense_engine(smollm2, 0)
    e.profile_every = 1  # what SetStepProfile does in the engine process
    stats, _ = run(e, prompts(smollm2.config.vocab_size, (20,)))
    assert stats and all(s.components is not None for s in stats)


def test_deepseek_v4_names_moe():
    src = resolve("dsv4-tiny", "dummy")
    src = dataclasses.replace(src, config=src.config.with_(qat_simulation=False))
    cfg = EngineConfig(
        model="dsv4-tiny",
        load_format="dummy",
        device="cpu",
        dtype="float32",
        step_profile_every=1,
        cache=CacheConfig(max_total_tokens=2048),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )
    stats, outs = run(Engine(cfg, src), prompts(250))
    assert len(outs) == 3 and all(len(t) == PARAMS.max_tokens for t, _ in outs)
    for s in stats:
        check_split(s, {"attention", "moe"})


def test_nested_regions_count_once():
    p = StepProfiler(torch.device("cpu"))
    with p.region("attention"):
        with p.region("mlp"):  # ignored: would count twice
            sum(range(10000))
    split = p.finish(1000.0)
    assert set(split) == {"attention", "communication", "other"}
    assert split["attention"] > 0 and split["other"] == pytest.approx(1000.0 - split["attention"])
    assert p.finish(5.0) == {"communication": 0.0, "other": 5.0}  # reset after each step
