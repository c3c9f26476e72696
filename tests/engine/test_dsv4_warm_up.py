"""The DeepSeek-V4 warm-up (models/deepseek_v4/warm_up.py) runs its steps on padding only: every
sequence in the dummy page 0 and state slot 0. Here its steps run on the CPU torch path
(on the GPU they compile the fused glue; tests/gpu/test_dsv4_warm_up_gpu.py checks that) between
two halves of live requests: no page or state slot a request can hold changes, and the requests
give bitwise the same tokens and logprobs as without them."""

from __future__ import annotations

import pytest
import torch
from test_dsv4_engine import make_engine, prompt

from kvrelay.engine.engine import generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.engine.request import Request
from kvrelay.models.deepseek_v4.warm_up import warm_up_shapes, warm_up_steps

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


def _live_state(engine) -> dict[str, torch.Tensor]:
    """Every pool tensor without its dummy row 0 (page 0, or state slot 0)."""
    return {k.name: k.tensor[1:].clone() for k in engine.runner.transfer_layout()}


def _run_padding_steps(engine) -> None:
    r = engine.runner
    with torch.inference_mode():
        for step in warm_up_steps(r.page_size, 2048):  # from position 0, and a page in
            r.family.forward(step, None)


def test_padding_steps_touch_no_live_page_or_slot():
    engine = make_engine()
    prompts = [prompt(n, seed) for seed, n in enumerate((7, 90, 200))]
    reqs = [Request(f"r{i}", p, PARAMS, 0) for i, p in enumerate(prompts)]
    for req in reqs:  # prefilled and left in the engine, holding pages and slots
        engine.scheduler.add(req)
    engine.step()
    before = _live_state(engine)
    _run_padding_steps(engine)
    after = _live_state(engine)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert not changed, changed


def test_requests_around_padding_steps_equal_those_without():
    prompts = [prompt(n, 10 + seed) for seed, n in enumerate((3, 64, 150))]
    plain = make_engine()
    want = generate(plain, prompts, PARAMS)
    warmed = make_engine()
    _run_padding_steps(warmed)
    got = generate(warmed, prompts, PARAMS)
    assert [[o.token_ids for o in r] for r in got] == [[o.token_ids for o in r] for r in want]
    assert [[o.logprobs for o in r] for r in got] == [[o.logprobs for o in r] for r in want]
    warmed.check_idle_integrity()


def test_shapes_fit_the_step_budget_and_vary_in_tokens_and_sequences():
    for page_size, budget in ((64, 64), (128, 8192), (16, 4)):
        shapes = warm_up_shapes(page_size, budget)
        assert all(sum(c) <= budget and min(c) >= 1 for c in shapes)
        totals = [sum(c) for c in shapes]
        assert len(set(totals)) >= 3 and 1 in totals  # static, dynamic, and the size-1 variant
        assert {len(c) for c in shapes} >= {1, 2}
