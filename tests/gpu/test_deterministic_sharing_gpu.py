"""`--deterministic` on the GPU where requests share KV (tests/engine/test_deterministic_sharing.py's
workload: a group of n = 3 samples of one prompt beside two other requests, then later turns that
hit the first turn's cached pages beside a cold one): each request gives the very bits it gives
alone on an engine without the prefix cache. bf16 with CUDA graphs: smollm2-135m and dsv4-tiny
(NVFP4 experts, QAT) with dummy weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_deterministic_gpu import make_engine

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_deterministic_sharing import N, run, workload  # noqa: E402

from kvrelay.engine.messages import AddRequest  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model", ["smollm2-135m", "dsv4-tiny"])
def test_hits_and_n_samples_equal_each_alone_without_the_cache(model: str) -> None:
    eng = make_engine(True, model, prefix_cache=True)
    turn1, turn2 = workload(eng.runner.model_cfg.vocab_size)
    shared = {**run(eng, turn1), **run(eng, turn2)}
    assert eng.scheduler.prefix.hit_tokens >= (N - 1) * 32 + 3 * 32
    eng.check_idle_integrity()
    del eng
    ref = make_engine(True, model)
    for r in turn1 + turn2:  # each alone, no cache, no group
        alone = run(ref, [AddRequest(r.rid, r.prompt_ids, r.params)])[r.rid]
        assert alone == shared[r.rid], f"{r.rid} differs from its run alone"
