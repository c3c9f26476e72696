"""The prefix cache's host tier in an engine (CPU float32, greedy): device pools that hold about
one conversation, so every earlier conversation's pages go to host memory, and later turns hit
them there and load them back through the gate.

- SmolLM2 and dsv4-tiny give the tokens of a cache-off engine, at concurrency 1 (one request at
  a time) and 16 (one batch), and they really did offload, load back and hit;
- a race: the gate's copies delayed by random sleeps give bitwise the same tokens and logprobs
  as without delays (the forward waits at the gate, whatever the copies take).
"""

from __future__ import annotations

import random
import time

import pytest
from host_tier_workload import PARAMS, random_ids, tokens_of, workload
from test_dsv4_prefix_cache import make_engine as make_dsv4

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SMOL_PAGE_BYTES = 184_320  # SmolLM2-135M, float32, 4 tokens
DSV4_PAGE_BYTES = 46_848  # dsv4-tiny, float32, 16 tokens


def _gb(pages: int, page_bytes: int) -> float:
    return pages * page_bytes / (1 << 30)


def smol(host_pages: int = 0, prefix_cache: bool = True) -> Engine:
    """12 pages of 4 tokens on the device (about two conversations), 256-token steps."""
    cache = CacheConfig(
        page_size=4,
        max_total_tokens=48,
        prefix_cache=prefix_cache,
        host_cache_gb=_gb(host_pages, SMOL_PAGE_BYTES),
    )
    return Engine(
        EngineConfig(
            dtype="float32",
            cache=cache,
            scheduler=SchedulerConfig(max_num_batched_tokens=256, kv_reserve_ratio=0.0),
        )
    )


def dsv4(host_pages: int = 0, prefix_cache: bool = True) -> Engine:
    """12 pages of 16 tokens on the device."""
    return make_dsv4(
        budget=256,
        max_total_tokens=192,
        prefix_cache=prefix_cache,
        host_cache_gb=_gb(host_pages, DSV4_PAGE_BYTES),
    )


def _check_round_trips(engine: Engine, results) -> None:
    tier = engine.host_tier
    assert tier.offloaded > 0 and tier.loaded > 0
    p = engine.runner.page_size
    assert all(cached >= 3 * p for _, _, cached in results[4:])  # later turns all hit
    engine.check_idle_integrity()
    engine.flush_prefix_cache()
    assert engine.scheduler.page_pool.num_used == 0 and tier.slots.num_used == 0


@pytest.fixture(scope="module")
def smol_runs() -> dict:
    on, off = smol(host_pages=24), smol(host_pages=24, prefix_cache=False)
    assert off.host_tier is None  # --disable-prefix-cache turns the host tier off too
    runs = {"engine": on, "on": workload(on), "off": workload(off)}
    _check_round_trips(on, runs["on"])  # flushes: the engine is as new again
    return runs


def test_smollm2_hits_through_host_memory_equal_cache_off(smol_runs) -> None:
    assert tokens_of(smol_runs["on"]) == tokens_of(smol_runs["off"])


def test_dsv4_hits_through_host_memory_equal_cache_off() -> None:
    on = dsv4(host_pages=24)
    got = workload(on)
    assert tokens_of(got) == tokens_of(workload(dsv4(prefix_cache=False)))
    _check_round_trips(on, got)


def test_delayed_copies_give_bitwise_the_same_outputs(smol_runs, monkeypatch) -> None:
    """The gate's copies (on its worker thread) sleep at random before each cache kind: a
    forward that read the pool before they landed would see stale or reused pages (without the
    engine's wait most requests differ). And no forward starts with a copy outstanding."""
    engine = smol_runs["engine"]
    gate, loaded = engine.host_tier.gate, engine.host_tier.loaded
    rng = random.Random(0)
    monkeypatch.setattr(gate, "delay", lambda: time.sleep(rng.choice((0, 0, 0, 5e-4, 2e-3))))
    forward, outstanding = engine.runner.forward_step, []

    def checked_forward(*args, **kw):
        outstanding.append(gate.pending)
        return forward(*args, **kw)

    monkeypatch.setattr(engine.runner, "forward_step", checked_forward)
    assert workload(engine) == smol_runs["on"]  # tokens, logprobs and cached tokens
    assert engine.host_tier.loaded > loaded
    assert outstanding and not any(outstanding)


def test_a_failed_copy_fails_every_later_step_never_a_wrong_answer(monkeypatch) -> None:
    """A copy that raises leaves pages the tree thinks loaded half-written: the step fails its
    requests with a named error, and so does every later step (the gate stays shut), so the
    engine's health turns and nothing is ever answered from those pages."""
    engine = smol(host_pages=24)
    gate = engine.host_tier.gate

    def boom():
        raise OSError("host copy failed (test)")

    vocab, p = engine.src.config.vocab_size, engine.runner.page_size
    for i in range(4):  # fill the device pool so that later conversations push pages out
        generate(engine, [random_ids(4 * p, 50 + i, vocab)], PARAMS)
    monkeypatch.setattr(gate, "delay", boom)
    out = generate(engine, [random_ids(4 * p, 60, vocab)], PARAMS)[0]
    assert out[-1].finish_reason == "error" and "host copy failed (test)" in out[-1].error
    failed = engine.failed_steps
    assert failed >= 1 and gate.broken is not None
    monkeypatch.setattr(gate, "delay", None)
    later = generate(engine, [random_ids(2 * p, 70, vocab)], PARAMS)[0]
    assert later[-1].finish_reason == "error" and "host tier copy failed" in later[-1].error
    assert engine.failed_steps > failed
