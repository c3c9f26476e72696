"""A request without max_tokens (it may run to the end of the context) reserves KV for only a
bounded part of its output: a second request is admitted next to it, KV grows on demand, the
newest request is preempted (and recomputed) when the pool runs dry, and both finish with the
greedy tokens each gives alone."""

from __future__ import annotations

import pytest

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import EngineStats, SamplingParams

A = [(13 * j) % 5000 + 100 for j in range(40)]
B = [(7 * j + 1) % 5000 + 100 for j in range(24)]
RESERVE = 32  # output tokens admission reserves KV for (default 256: a GPU-sized pool)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a 2-layer model: tiny ops


def _engine() -> Engine:
    """A 160-token pool (10 pages of 16) that also limits the context."""
    return Engine(
        EngineConfig(
            model="qwen3-tiny",
            load_format="dummy",
            cache=CacheConfig(max_total_tokens=160, page_size=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, kv_reserve_max_tokens=RESERVE),
        )
    )


def _no_limit(engine: Engine, ids: list[int]) -> SamplingParams:
    """What the API asks for when a request names no max_tokens: the rest of the context."""
    return SamplingParams(
        max_tokens=engine.max_model_len - len(ids), temperature=0.0, ignore_eos=True
    )


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_request_without_max_tokens_does_not_block_the_next_one() -> None:
    alone = _engine()
    want = [_tokens(generate(alone, [ids], _no_limit(alone, ids))[0]) for ids in (A, B)]
    assert [len(w) for w in want] == [120, 136]  # each runs to the end of the 160-token context

    eng = _engine()
    steps: list[EngineStats] = []
    outs = generate(eng, [A, B], [_no_limit(eng, A), _no_limit(eng, B)], steps)
    # Both admitted at once: A reserves its prompt + 32 output tokens (5 pages), not the whole
    # pool (10 pages, all of which a full reservation would take).
    assert steps[0].num_running == 2
    # Together they need 320 tokens of a 160-token pool: B was preempted and recomputed.
    assert eng.scheduler.num_preemptions > 0
    assert [_tokens(o) for o in outs] == want
    assert all(o[-1].finish_reason == "length" for o in outs)
    eng.check_idle_integrity()
    eng.flush_prefix_cache()  # what the prefix cache alone holds
    assert eng.scheduler.page_pool.num_used == 0
