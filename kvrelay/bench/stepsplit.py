"""Where a decode step's time goes, from the engine's profiled steps (`--step-profile-every N`):
the mean milliseconds and share of each component (attention, mlp or moe, communication, other)
and, across batch sizes, each component's own line `ms = a + b * batch` — which part is the
per-sequence slope (attention, usually) and which a flat floor (weights read once: MLP/MoE)."""

from __future__ import annotations

from kvrelay.bench.stepfit import fit_line, is_decode

ORDER = ("attention", "mlp", "moe", "communication", "other")


def component_split(steps: list[dict] | list[list[dict]]) -> dict | None:
    """The split of a level's profiled decode steps, or a sweep's (a list of levels' steps, each
    level weighing the same in the lines); None when no decode step was profiled."""
    levels = steps if steps and isinstance(steps[0], list) else [steps]
    profiled = [[s for s in lv if is_decode(s) and "components" in s] for lv in levels]
    chosen = [s for lv in profiled for s in lv]
    if not chosen:
        return None
    weights = [1.0 / len(lv) for lv in profiled for _ in lv]
    names = sorted({k for s in chosen for k in s["components"]}, key=_rank)
    step_ms = sum(s["step_ms"] for s in chosen) / len(chosen)
    components = {}
    for name in names:
        ms = [s["components"].get(name, 0.0) for s in chosen]
        mean = sum(ms) / len(ms)
        fit = fit_line(
            [(float(s["batch_size"]), m) for s, m in zip(chosen, ms, strict=True)], weights
        )
        components[name] = {
            "ms_mean": mean,
            "share": mean / step_ms if step_ms > 0 else None,
            "a_ms": fit["a"],
            "b_ms_per_seq": fit["b"],
            "r2": fit["r2"],
        }
    batches = [s["batch_size"] for s in chosen]
    return {
        "num_steps": len(chosen),
        "batch_min": min(batches),
        "batch_max": max(batches),
        "batch_mean": sum(batches) / len(batches),
        "step_ms_mean": step_ms,
        "components": components,
    }


def _rank(name: str) -> tuple[int, str]:
    return (ORDER.index(name) if name in ORDER else len(ORDER), name)


def describe_split(split: dict | None, label: str = "decode step") -> str | None:
    """One line: 'decode step split (24 profiled steps, batch 1-64, 7.10 ms): attention 2.10 ms
    30% (0.90 + 0.050·batch) | mlp 3.00 ms 42% | ...' (a component's line where its slope moves it
    by more than 5% over the batch range). None without profiled steps."""
    if split is None:
        return None
    parts = []
    for name, c in split["components"].items():
        part = f"{name} {c['ms_mean']:.2f} ms"
        if c["share"] is not None:
            part += f" {100 * c['share']:.0f}%"
        b, span = c["b_ms_per_seq"], split["batch_max"] - split["batch_min"]
        if b is not None and abs(b) * span > 0.05 * c["ms_mean"]:  # a line only where it slopes
            part += f" ({c['a_ms']:.2f} + {b:.3f}·batch)"
        parts.append(part)
    b0, b1 = split["batch_min"], split["batch_max"]
    where = f"batch {b0}" if b0 == b1 else f"batch {b0}-{b1}"
    return (
        f"{label} split ({split['num_steps']} profiled steps, {where}, "
        f"mean {split['step_ms_mean']:.2f} ms): " + " | ".join(parts)
    )
