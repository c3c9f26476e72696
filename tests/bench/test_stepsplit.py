"""The decode-step split from profiled steps: known per-component lines come back, shares add up,
and steps that were not profiled (or prefilled) are left out."""

from __future__ import annotations

import pytest

from kvrelay.bench.stepsplit import component_split, describe_split


def step(batch: int, prefill: int = 0, profiled: bool = True) -> dict:
    attention, mlp, other = 0.5 + 0.2 * batch, 3.0, 1.0
    s = {"batch_size": batch, "num_prefill": prefill, "step_ms": attention + mlp + other}
    if profiled:
        s["components"] = {"communication": 0.0, "attention": attention, "mlp": mlp, "other": other}
    return s


def test_lines_and_shares_recovered():
    steps = [step(b) for b in (1, 2, 4, 8, 16, 32)] + [step(64, prefill=1), step(5, profiled=False)]
    split = component_split(steps)
    assert split["num_steps"] == 6 and (split["batch_min"], split["batch_max"]) == (1, 32)
    c = split["components"]
    assert list(c) == ["attention", "mlp", "communication", "other"]  # the report's order
    assert (c["attention"]["a_ms"], c["attention"]["b_ms_per_seq"]) == pytest.approx((0.5, 0.2))
    assert c["mlp"]["b_ms_per_seq"] == pytest.approx(0.0, abs=1e-12)
    assert c["mlp"]["a_ms"] == pytest.approx(3.0)
    assert sum(x["share"] for x in c.values()) == pytest.approx(1.0)
    line = describe_split(split, "c=8")
    assert line.startswith("c=8 split (6 profiled steps, batch 1-32, mean ")
    assert "attention 2.60 ms 39% (0.50 + 0.200·batch) | mlp 3.00 ms 45% | comm" in line


def test_sweep_weighs_levels_and_none_without_profiles():
    split = component_split([[step(1)] * 9, [step(9)]])
    assert split["components"]["attention"]["b_ms_per_seq"] == pytest.approx(0.2)
    assert component_split([step(4, profiled=False), step(4, prefill=2)]) is None
    assert component_split([]) is None and describe_split(None) is None
    one = describe_split(component_split([step(4)]))
    assert "batch 4," in one and "·batch" not in one  # one batch size: no line to show
