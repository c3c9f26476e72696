"""Confidence intervals for paired A/B trials: Student's t quantiles from a table (no scipy) and
the relative difference of B over A, paired by trial index."""

from __future__ import annotations

import math
import statistics

# Two-sided confidence level -> t quantiles for 1..30 degrees of freedom, then 40, 60, 120, inf.
_DF = (*range(1, 31), 40, 60, 120, math.inf)
_T = {
    0.90: (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
           1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
           1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697,
           1.684, 1.671, 1.658, 1.645),
    0.95: (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
           2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
           2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
           2.021, 2.000, 1.980, 1.960),
    0.99: (63.657, 9.925, 5.841, 4.604, 4.032, 3.707, 3.499, 3.355, 3.250, 3.169,
           3.106, 3.055, 3.012, 2.977, 2.947, 2.921, 2.898, 2.878, 2.861, 2.845,
           2.831, 2.819, 2.807, 2.797, 2.787, 2.779, 2.771, 2.763, 2.756, 2.750,
           2.704, 2.660, 2.617, 2.576),
}  # fmt: skip
LEVELS = tuple(_T)


def t_quantile(df: int, confidence: float = 0.95) -> float:
    """The t value with `confidence` of the distribution within ±t; beyond 30 degrees of freedom,
    linear in 1/df between the table's rows (exact to about 0.001)."""
    if df < 1:
        raise ValueError("degrees of freedom must be at least 1")
    if confidence not in _T:
        raise ValueError(f"confidence must be one of {LEVELS}")
    row = _T[confidence]
    if df <= 30:
        return row[df - 1]
    for i in range(30, len(_DF)):
        if df <= _DF[i]:
            lo, hi = _DF[i - 1], _DF[i]
            w = (1 / lo - 1 / df) / (1 / lo - (0 if math.isinf(hi) else 1 / hi))
            return row[i - 1] + w * (row[i] - row[i - 1])
    return row[-1]


def paired_relative_difference(a: list[float], b: list[float], confidence: float = 0.95) -> dict:
    """Mean of b_i / a_i - 1 over trials i, with its confidence interval (None with one trial).
    Pairing by trial removes what drifts over time (other load, thermals) from the comparison."""
    if len(a) != len(b) or not a:
        raise ValueError("need the same number (at least one) of A and B values")
    if any(x <= 0 for x in a):
        raise ValueError("A's values must be positive for a relative difference")
    d = [y / x - 1 for x, y in zip(a, b, strict=True)]
    n, mean = len(d), statistics.fmean(d)
    half = t_quantile(n - 1, confidence) * statistics.stdev(d) / math.sqrt(n) if n > 1 else None
    return {
        "n": n,
        "confidence": confidence,
        "mean": mean,
        "half_width": half,
        "low": None if half is None else mean - half,
        "high": None if half is None else mean + half,
        # Significant: the interval leaves out 0 (no difference).
        "significant": half is not None and (mean - half > 0 or mean + half < 0),
        "a_mean": statistics.fmean(a),
        "b_mean": statistics.fmean(b),
        "per_trial": d,
    }
