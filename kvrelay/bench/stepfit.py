"""The step-time model: a least-squares line `step_ms = a + b * batch` over decode-only engine steps.

`a` is the fixed cost of a step (weights read once, launch and framework overhead); `b` the cost of
each extra sequence in the batch (mostly attention over its KV). Prefill steps are left out: their
cost grows with prompt tokens, not with the batch.
"""

from __future__ import annotations

from collections.abc import Iterable


def decode_steps(steps: Iterable[dict]) -> list[tuple[int, float]]:
    """(batch size, step ms) of the steps that decoded only."""
    return [
        (s["batch_size"], s["step_ms"])
        for s in steps
        if s["batch_size"] > 0 and not s.get("num_prefill", 0)
    ]


def fit_line(points: list[tuple[float, float]]) -> dict | None:
    """Least squares y = a + b x. None without points. With a single x value the slope is
    unknown: b and r2 are None and a is the mean. r2 is None when y does not vary at all."""
    n = len(points)
    if n == 0:
        return None
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    syy = sum((y - my) ** 2 for _, y in points)
    if sxx == 0:
        return {"a": my, "b": None, "r2": None, "n": n}
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    a = my - b * mx
    sse = sum((y - a - b * x) ** 2 for x, y in points)
    return {"a": a, "b": b, "r2": None if syy == 0 else 1.0 - sse / syy, "n": n}


def fit_step_time(steps: list[dict]) -> dict | None:
    """The model fitted to a run's steps, with what it was fitted on; None without decode steps."""
    points = decode_steps(steps)
    fit = fit_line([(float(b), ms) for b, ms in points])
    if fit is None:
        return None
    batches = [b for b, _ in points]
    return {
        "a_ms": fit["a"],
        "b_ms_per_seq": fit["b"],
        "r2": fit["r2"],
        "n": fit["n"],
        "batch_min": min(batches),
        "batch_max": max(batches),
        "num_steps": len(steps),
        "num_prefill_steps": len(steps) - len(points),
    }


def describe(fit: dict | None) -> str:
    """One line: 'step_ms = 18.0 + 1.05·batch (R² 0.97, 812 decode steps, batch 1-64)'."""
    if fit is None:
        return "step time: no decode steps recorded"
    where = f"{fit['n']} decode steps, batch {fit['batch_min']}-{fit['batch_max']}"
    if fit["b_ms_per_seq"] is None:
        return f"step_ms = {fit['a_ms']:.2f} (one batch size only: no slope; {where})"
    r2 = "-" if fit["r2"] is None else f"{fit['r2']:.3f}"
    return f"step_ms = {fit['a_ms']:.2f} + {fit['b_ms_per_seq']:.3f}·batch (R² {r2}, {where})"
