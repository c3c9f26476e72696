"""The test-only fault flag swaps sampled tokens only when the running batch exceeds k."""

from __future__ import annotations

import pytest

from kvrelay.config import CacheConfig, EngineConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [50, 60, 70, 80, 90]]


def _engine(p: float, k: int) -> Engine:
    return Engine(
        EngineConfig(
            model="qwen3-tiny",
            load_format="dummy",
            device="cpu",
            dtype="float32",
            cache=CacheConfig(max_total_tokens=512),
            fault_swap_token_p=p,
            fault_swap_token_min_batch=k,
        )
    )


def _tokens(outs):
    return [[t for o in out for t in o.token_ids] for out in outs]


def test_fault_fires_only_above_the_batch_threshold():
    clean = _tokens(generate(_engine(0.0, 0), PROMPTS, GREEDY))
    faulty = _engine(1.0, 1)
    assert _tokens(generate(faulty, PROMPTS, GREEDY)) != clean  # batch of 2 > 1: corrupted
    assert [_tokens(generate(faulty, [p], GREEDY))[0] for p in PROMPTS] == clean  # batch 1: clean
