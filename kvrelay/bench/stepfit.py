"""The step-time model: a least-squares line `step_ms = a + b * batch` over decode-only engine steps.

`a` is the fixed cost of a step (weights read once, launch and framework overhead); `b` the cost of
each extra sequence in the batch (mostly attention over its KV). Prefill steps are left out: their
cost grows with prompt tokens, not with the batch; so are profiled steps (their timing events cost
a little) when there are others. A sweep weighs each level equally: concurrency 1 runs the most steps.
"""

from __future__ import annotations

from collections.abc import Iterable


def is_decode(step: dict) -> bool:
    return step["batch_size"] > 0 and not step.get("num_prefill", 0)


def decode_steps(steps: Iterable[dict]) -> list[tuple[int, float]]:
    """(batch size, step ms) of the steps that decoded only."""
    return [(s["batch_size"], s["step_ms"]) for s in steps if is_decode(s)]


def fit_line(points: list[tuple[float, float]], weights: list[float] | None = None) -> dict | None:
    """Least squares y = a + b x (weighted if `weights`). None without points. With a single x
    value the slope is unknown: b and r2 are None and a is the mean. r2 is None when y does not
    vary at all."""
    n = len(points)
    if n == 0:
        return None
    w = weights or [1.0] * n
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, points, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points, strict=True))
    syy = sum(wi * (y - my) ** 2 for wi, (_, y) in zip(w, points, strict=True))
    if sxx <= 1e-12 * sw * max(mx * mx, 1.0):
        return {"a": my, "b": None, "r2": None, "n": n}
    b = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points, strict=True)) / sxx
    a = my - b * mx
    sse = sum(wi * (y - a - b * x) ** 2 for wi, (x, y) in zip(w, points, strict=True))
    return {"a": a, "b": b, "r2": None if syy == 0 else 1.0 - sse / syy, "n": n}


def _fit_steps(levels: list[list[dict]]) -> tuple[list[dict], list[float]]:
    """The decode steps of the levels and their weights (each level weighs 1 in all). Profiled
    steps (timing events in the graph, or eager) are left out unless every decode step was."""
    dec = [[s for s in lv if is_decode(s)] for lv in levels]
    if any("components" not in s for lv in dec for s in lv):
        dec = [[s for s in lv if "components" not in s] for lv in dec]
    return [s for lv in dec for s in lv], [1.0 / len(lv) for lv in dec for _ in lv]


def fit_step_time(steps: list[dict] | list[list[dict]]) -> dict | None:
    """The model fitted to a level's steps, or to a sweep's (a list of levels' steps, each level
    weighing the same), with what it was fitted on; None without decode steps."""
    levels = steps if steps and isinstance(steps[0], list) else [steps]
    chosen, weights = _fit_steps(levels)
    fit = fit_line([(float(s["batch_size"]), s["step_ms"]) for s in chosen], weights)
    if fit is None:
        return None
    batches = [s["batch_size"] for s in chosen]
    num_steps = sum(len(lv) for lv in levels)
    num_decode = sum(1 for lv in levels for s in lv if is_decode(s))
    return {
        "a_ms": fit["a"],
        "b_ms_per_seq": fit["b"],
        "r2": fit["r2"],
        "n": fit["n"],
        "batch_min": min(batches),
        "batch_max": max(batches),
        "num_steps": num_steps,
        "num_prefill_steps": num_steps - num_decode,
        "num_profiled_left_out": num_decode - len(chosen),
        "weighted_by_level": len(levels) > 1,
    }


def describe(fit: dict | None) -> str:
    """One line: 'step_ms = 18.0 + 1.05·batch (R² 0.97, 812 decode steps, batch 1-64)'."""
    if fit is None:
        return "step time: no decode steps recorded"
    where = f"{fit['n']} decode steps, batch {fit['batch_min']}-{fit['batch_max']}"
    if fit.get("weighted_by_level"):
        where += ", levels weighted equally"
    if fit.get("num_profiled_left_out"):
        where += f", {fit['num_profiled_left_out']} profiled steps left out"
    if fit["b_ms_per_seq"] is None:
        return f"step_ms = {fit['a_ms']:.2f} (one batch size only: no slope; {where})"
    r2 = "-" if fit["r2"] is None else f"{fit['r2']:.3f}"
    return f"step_ms = {fit['a_ms']:.2f} + {fit['b_ms_per_seq']:.3f}·batch (R² {r2}, {where})"
