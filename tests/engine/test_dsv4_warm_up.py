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
from kvrelay.kernels.triton_moe import default_config
from kvrelay.models.deepseek_v4.warm_up import (
    moe_config_token_counts,
    variant_token_counts,
    warm_up_shapes,
    warm_up_steps,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


def _live_state(engine) -> dict[str, torch.Tensor]:
    """Every pool tensor without its dummy row 0 (page 0, or state slot 0)."""
    return {k.name: k.tensor[1:].clone() for k in engine.runner.transfer_layout()}


def _run_padding_steps(engine) -> None:
    r = engine.runner
    c = r.family.model_cfg
    moe = moe_config_token_counts(c.n_routed_experts, c.num_experts_per_tok, 2048)
    assert len(moe) > 1  # the tiny model's budget reaches more than one tile config
    with torch.inference_mode():
        for step in warm_up_steps(r.page_size, 2048, moe):  # from position 0, a page in, MoE
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


def test_one_moe_step_per_tile_config_the_budget_reaches():
    # DeepSeek-V4's routing (256 experts, 6 each): a new config past 2, 5.3 and 10.7 rows per expert
    assert moe_config_token_counts(256, 6, 8192) == [1, 513, 1366, 2731]
    assert moe_config_token_counts(256, 6, 1000) == [1, 513]
    for e, k, budget in ((256, 6, 8192), (8, 2, 2048), (16, 4, 64)):
        counts = moe_config_token_counts(e, k, budget)
        configs = {default_config(t * k, e) for t in range(1, budget + 1)}
        assert {default_config(t * k, e) for t in counts} == configs  # every one reached
        assert len(counts) == len(configs) and counts[0] == 1 and max(counts) <= budget
        steps = warm_up_steps(16, budget, counts)
        totals = {sum(s.counts) for s in steps}
        assert set(counts) <= totals and all(t <= budget for t in totals)


def test_a_step_past_the_mhc_pre_limit_when_no_expert_config_reaches_it():
    """The mHC gates kernel serves steps of more than hc_pre_max_tokens tokens: the warm-up has
    one such step wherever the budget allows one, from an expert config's count or its own."""
    from types import SimpleNamespace

    agent = SimpleNamespace(n_routed_experts=8, num_experts_per_tok=2)  # configs switch early
    flash = SimpleNamespace(n_routed_experts=256, num_experts_per_tok=6)  # 513 tokens is one
    assert max(moe_config_token_counts(8, 2, 2048)) <= 512
    assert variant_token_counts(agent, 512, 2048)[-1] == 513
    assert variant_token_counts(agent, 512, 512) == moe_config_token_counts(8, 2, 512)
    assert variant_token_counts(flash, 512, 8192) == [1, 513, 1366, 2731]
    assert variant_token_counts(agent, 0, 2048) == moe_config_token_counts(8, 2, 2048)  # no hc_pre
