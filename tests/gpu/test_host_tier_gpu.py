"""The prefix cache's host tier on CUDA: a pinned host store, copies on the gate's copy stream, the
compute stream waiting on its event, Triton kernels and CUDA graphs on (float32, SmolLM2's shape
with dummy weights). Hits through host memory give the tokens and logprobs of a cache-off engine,
and with the copy stream stalled inside every copy (torch.cuda._sleep) the outputs stay bitwise
the same: a forward that did not wait at the gate would read pages still being copied."""

from __future__ import annotations

import pytest
import torch
from host_tier_workload import tokens_of, workload

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine

pytestmark = pytest.mark.gpu
PAGE_BYTES = 737_280  # SmolLM2-135M shape, float32, 16 tokens


def _engine(prefix_cache: bool = True, host_pages: int = 0, deterministic: bool = False) -> Engine:
    """12 device pages of 16 tokens (about two conversations of the workload); bf16 in the
    batch-invariant mode (a page's bytes are then half of PAGE_BYTES: twice the host pages)."""
    return Engine(
        EngineConfig(
            model="smollm2-135m",
            load_format="dummy",
            dtype="bfloat16" if deterministic else "float32",
            deterministic=deterministic,
            cache=CacheConfig(
                max_total_tokens=12 * 16,
                prefix_cache=prefix_cache,
                host_cache_gb=host_pages * PAGE_BYTES / (1 << 30),
            ),
            scheduler=SchedulerConfig(max_num_batched_tokens=256, kv_reserve_ratio=0.0),
        )
    )


@pytest.fixture(scope="module")
def runs() -> dict:
    on = _engine(host_pages=24)
    assert (
        on.host_tier is not None
        and on.host_tier.gate.host[next(iter(on.host_tier.gate.host))].is_pinned()
    )
    return {"engine": on, "on": workload(on), "off": workload(_engine(prefix_cache=False))}


def test_hits_through_pinned_host_memory_equal_cache_off(runs) -> None:
    tier = runs["engine"].host_tier
    assert tier.offloaded > 0 and tier.loaded > 0
    assert tokens_of(runs["on"]) == tokens_of(runs["off"])
    assert all(cached >= 3 * 16 for _, _, cached in runs["on"][4:])


def test_stalled_copy_stream_gives_bitwise_the_same_outputs(runs, monkeypatch) -> None:
    engine = runs["engine"]
    engine.flush_prefix_cache()  # the same cold start as the first run
    gate, loaded = engine.host_tier.gate, engine.host_tier.loaded
    # Runs on the copy stream inside each kind's copy: ~1 ms of GPU time before the copy lands.
    monkeypatch.setattr(gate, "delay", lambda: torch.cuda._sleep(2_000_000))
    assert workload(engine) == runs["on"]  # tokens, logprobs and cached tokens
    assert engine.host_tier.loaded > loaded


def test_deterministic_hits_through_host_memory_equal_cache_off_bitwise() -> None:
    """`--deterministic` (bf16, graphs): later turns resumed from pages loaded back from host
    memory, and the 16 third turns in one batch, give the tokens and logprobs of a cache-off
    engine bit for bit (a hit moves where a prompt's prefill starts and what shares its steps)."""
    on = _engine(host_pages=24, deterministic=True)
    got = workload(on)
    assert on.host_tier.offloaded > 0 and on.host_tier.loaded > 0
    want = workload(_engine(prefix_cache=False, deterministic=True))
    assert [r[:2] for r in got] == [r[:2] for r in want]
