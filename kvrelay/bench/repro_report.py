"""`kvrelay repro` output: the Wilson interval, the divergence highlight, and the terminal report."""

from __future__ import annotations

import math

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n (sound at k = 0 and for small n)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if k == 0 else max(0.0, centre - half)  # exact ends, not rounding noise
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


def highlight(
    ref: list[str], test: list[str], pos: int, before: int = 160, after: int = 160
) -> str:
    """Text up to the first divergence, then [[reference token|test token]], then the test's
    continuation; a side that ended there shows as ∅."""
    head = "".join(ref[:pos])
    if len(head) > before:
        head = "…" + head[-before:]
    a = ref[pos] if pos < len(ref) else "∅"
    b = test[pos] if pos < len(test) else "∅"
    tail = "".join(test[pos + 1 :])
    if len(tail) > after:
        tail = tail[:after] + "…"
    return f"{head}[[{a}|{b}]]{tail}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items() if v) or "-"


def failure_lines(result: dict) -> list[str]:
    """For the reference and each level with failed requests: how many, by cause (HTTP status,
    bad_response, exception:<type>), then the first failures word for word."""
    lines = []
    parts = [("reference", result["reference"])]
    parts += [(f"concurrency {lv['concurrency']}", lv) for lv in result["levels"]]
    for name, part in parts:
        if not part["failed_requests"]:
            continue
        causes = ", ".join(f"{k} {n}" for k, n in (part.get("failure_causes") or {}).items())
        lines.append(f"{name}: {part['failed_requests']} failed requests, by cause: {causes}")
        lines += [
            f"  [{e['cause']}] session {e['session']} turn {e['turn']}: {e['error']}"
            for e in part.get("error_examples") or []
        ]
    return lines


def print_report(result: dict, out) -> None:
    ref = result["reference"]
    out.write(
        f"reference: {ref['url']} ({result['model']}), concurrency {ref['concurrency']}, "
        f"{ref['sessions']} sessions x {result['config']['turns']} turns, {ref['duration_s']}s, "
        f"failed requests {ref['failed_requests']}\n"
        f"  its own findings (the model's habits, not counted): {_counts(ref['detectors'])}\n"
    )
    if ref.get("batched"):
        out.write(
            f"  note: the reference itself ran at concurrency {ref['concurrency']} > 1, so it is "
            "not a batch-free baseline: damage that also struck it goes unseen\n"
        )
    out.write(f"under test: {result['url']}\n")
    out.write(
        f"{'conc':>5} {'sessions':>8} {'corrupt':>7} {'rate':>6} {'95% CI':>15} {'div turns':>9} "
        f"{'near-tie':>8} {'failed':>6} {'secs':>7}  new detector findings\n"
    )
    for lv in result["levels"]:
        lo, hi = lv["ci95"]
        out.write(
            f"{lv['concurrency']:>5} {lv['compared']:>8} {lv['corrupted']:>7} "
            f"{_pct(lv['rate']):>6} {'[' + _pct(lo) + ', ' + _pct(hi) + ']':>15} "
            f"{lv['divergent_turns']:>9} {lv['near_tie_turns']:>8} {lv['failed_requests']:>6} "
            f"{lv['duration_s']:>7}  {_counts(lv['detectors'])}\n"
        )
        if lv.get("after_near_tie_turns"):
            out.write(
                f"{'':>5} after a near-tie (other text, not counted): "
                f"{_counts(lv['after_near_tie'])} in {lv['after_near_tie_turns']} turns\n"
            )
    for line in failure_lines(result):
        out.write(line + "\n")
    if result["examples"]:
        out.write("worst examples (reference text, then [[reference|test]] and the test's text):\n")
    for i, ex in enumerate(result["examples"], 1):
        where = f"#{i} concurrency {ex['concurrency']}, session {ex['session']}, turn {ex['turn']}"
        if ex["first_divergence"] is not None:
            gap = ex["ref_top2_gap"]
            where += f": first divergence at token {ex['first_divergence']}" + (
                f" (reference top-2 gap {gap:.2f})" if gap is not None else ""
            )
        out.write(where + "\n")
        for f in ex["findings"]:
            out.write(f"    {f['detector']}: {f['detail']}\n")
        if ex["highlight"] is not None:
            out.write("    " + ex["highlight"].replace("\n", "\\n") + "\n")
    out.write(f"verdict: {result['verdict']}\n")
