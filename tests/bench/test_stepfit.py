"""The step-time model fit on synthetic steps: known coefficients come back, prefill is left out."""

from __future__ import annotations

import random

import pytest

from kvrelay.bench.stepfit import describe, fit_line, fit_step_time


def steps(points, prefill: int = 0) -> list[dict]:
    return [{"batch_size": b, "step_ms": ms, "num_prefill": prefill} for b, ms in points]


def test_perfect_line_recovered_with_r2_one():
    fit = fit_step_time(steps([(b, 18.0 + 1.05 * b) for b in (1, 2, 4, 8, 16, 32, 64)]))
    assert fit["a_ms"] == pytest.approx(18.0) and fit["b_ms_per_seq"] == pytest.approx(1.05)
    assert fit["r2"] == pytest.approx(1.0) and fit["n"] == 7
    assert (fit["batch_min"], fit["batch_max"]) == (1, 64)
    assert describe(fit).startswith("step_ms = 18.00 + 1.050·batch (R² 1.000, 7 decode steps")


def test_noisy_line_close_and_prefill_steps_ignored():
    rng = random.Random(0)
    decode = [(b, 5.0 + 0.5 * b + rng.gauss(0, 0.5)) for b in range(1, 65) for _ in range(20)]
    prefill = [(b, 500.0) for b in range(1, 65)]  # far off the line: would ruin the fit
    fit = fit_step_time(steps(decode) + steps(prefill, prefill=1))
    assert fit["a_ms"] == pytest.approx(5.0, abs=0.2)
    assert fit["b_ms_per_seq"] == pytest.approx(0.5, abs=0.01)
    assert 0.95 < fit["r2"] < 1.0
    assert (fit["n"], fit["num_steps"], fit["num_prefill_steps"]) == (1280, 1344, 64)


def test_degenerate_inputs():
    assert fit_step_time([]) is None and describe(None).endswith("no decode steps recorded")
    assert fit_step_time(steps([(4, 9.0)], prefill=2)) is None
    one = fit_step_time(steps([(4, 9.0), (4, 11.0)]))  # one batch size: no slope
    assert one["a_ms"] == 10.0 and one["b_ms_per_seq"] is None and one["r2"] is None
    assert "no slope" in describe(one)
    flat = fit_line([(1, 3.0), (2, 3.0)])
    assert flat == {"a": 3.0, "b": 0.0, "r2": None, "n": 2}


def test_sweep_weighs_each_level_equally():
    # Level 1 runs three times the steps of level 2: as a sweep, each level weighs the same,
    # which is the plain fit on level 2's points repeated three times.
    lv1 = steps([(1, 10.0), (1, 11.0), (2, 12.5)])
    lv2 = steps([(8, 20.0)])
    got = fit_step_time([lv1, lv2])
    want = fit_line([(1, 10.0), (1, 11.0), (2, 12.5)] + [(8, 20.0)] * 3)
    assert (got["a_ms"], got["b_ms_per_seq"], got["r2"]) == pytest.approx(
        (want["a"], want["b"], want["r2"])
    )
    assert got["weighted_by_level"] and got["n"] == 4
    assert "levels weighted equally" in describe(got)
    assert fit_line([(1, 1.0), (2, 3.0), (3, 4.0)], [1, 2, 1]) == pytest.approx(
        fit_line([(1, 1.0), (2, 3.0), (2, 3.0), (3, 4.0)]) | {"n": 3}
    )


def test_profiled_steps_left_out_unless_all_are():
    plain = steps([(b, 2.0 + b) for b in (1, 2, 4)])
    eager = [s | {"components": {"other": 50.0}, "step_ms": 50.0} for s in steps([(3, 0)])]
    fit = fit_step_time(plain + eager)  # the eager step would pull the line far off
    assert fit["a_ms"] == pytest.approx(2.0) and fit["b_ms_per_seq"] == pytest.approx(1.0)
    assert fit["num_profiled_left_out"] == 1 and "1 profiled steps left out" in describe(fit)
    only = fit_step_time(eager * 2)
    assert only["a_ms"] == 50.0 and only["num_profiled_left_out"] == 0
