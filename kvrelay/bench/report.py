"""Bench results out: a terminal table (rich when installed), the JSON file, and PNG plots of
latency percentiles and throughput against the load level."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO

from kvrelay.bench.metrics import (
    NUM_ERROR_EXAMPLES,
    describe_causes,
    error_kind,
    percentile_key,
)
from kvrelay.bench.stepfit import describe
from kvrelay.bench.stepsplit import describe_split

LATENCIES = (
    ("ttft_ms", "TTFT"),
    ("tpot_ms", "TPOT"),
    ("itl_ms", "ITL"),
    ("e2el_ms", "E2E latency"),
)


def level_label(level: dict) -> str:
    if level["mode"] == "closed":
        return f"c={level['concurrency']}"
    rate = level["request_rate"]
    return f"{rate:g}/s" if isinstance(rate, int | float) else f"{rate}/s"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}" if x < 1000 else f"{x:,.0f}"


def table_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the summary table: p50 and the highest requested percentile."""
    pcts = result["config"]["percentiles"]
    hi = percentile_key(max(pcts)) if pcts else "max"
    lo = percentile_key(50) if 50 in pcts else "mean"
    slo = bool(result["config"]["slo"])
    header = ["level", "ok", "fail", "req/s", "out tok/s"]
    header += [f"{name} {lo}/{hi} ms" for _, name in LATENCIES]
    header += (["goodput req/s"] if slo else []) + ["server tok", "counters"]
    spec = any(
        (lv.get("server") or {}).get("spec_decode_mean_accepted_length") for lv in result["levels"]
    )
    if spec:  # a speculating server: tokens per verify step (1 + accepted drafts), per level
        header.append("accept len")
    rows = []
    for lv in result["levels"]:
        row = [
            level_label(lv),
            str(lv["completed"]),
            str(lv["failed"]),
            f"{lv['request_throughput']:.2f}",
            f"{lv['output_throughput']:.1f}",
        ]
        row += [f"{_ms(lv[key][lo])} / {_ms(lv[key][hi])}" for key, _ in LATENCIES]
        if slo:
            row.append(f"{lv['goodput']:.2f} ({lv['good_requests']}/{lv['num_requests']})")
        server = lv.get("server") or {}
        gen = server.get("generation_tokens")
        row.append("-" if gen is None else f"{gen:.0f}")
        row.append({True: "agree", False: "DIFFER", None: "-"}[lv.get("counters_agree")])
        if spec:
            length = server.get("spec_decode_mean_accepted_length")
            row.append("-" if length is None else f"{length:.2f}")
        rows.append(row)
    return header, rows


def error_lines(result: dict) -> list[str]:
    """Per level with failures: how many failed, by cause (HTTP status, stream_error,
    exception:<type>, ...); the first failures word for word; then each other kind of failure
    (messages that differ only in numbers are one kind) with its count and an example."""
    lines = []
    for lv in result["levels"]:
        if not lv["failed"]:
            continue
        label = level_label(lv)
        causes = lv.get("failure_causes") or {}
        lines.append(f"{label}: {lv['failed']} failed, by cause: {describe_causes(causes) or '-'}")
        examples = lv.get("error_examples") or []
        shown = {error_kind(e["error"]) for e in examples}
        lines += [f"  [{e['cause']}] {e['error']}" for e in examples]
        lines += [
            f"  and {g['count']} like: {g['error']}"
            for g in lv["errors"]
            if error_kind(g["error"]) not in shown
        ][:NUM_ERROR_EXAMPLES]
    return lines


def step_fit_line(result: dict) -> list[str]:
    """The step-time model fitted over the sweep and, for profiled runs, the split of a decode
    step per level and the components' lines over the sweep; if the server reported steps."""
    if all(lv.get("steps_dropped") is None for lv in result["levels"]):
        return []  # a server without /telemetry/steps
    lines = [describe(result.get("step_fit"))]
    per_level = [describe_split(lv.get("step_split"), level_label(lv)) for lv in result["levels"]]
    lines += [line for line in per_level if line]
    if len(result["levels"]) > 1 and result.get("step_split"):
        lines.append(describe_split(result["step_split"], "sweep"))
    return lines


def print_table(result: dict, file: IO[str]) -> None:
    """The summary table on a terminal (rich if installed, else aligned plain text), then the
    failures."""
    header, rows = table_rows(result)
    title = (
        f"kvrelay bench: {result['config']['workload']['dataset']} on {result['model']} "
        f"({result['config']['mode']} loop)"
    )
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        file.write(title + "\n")
        for r in [header, *rows]:
            file.write("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + "\n")
        file.writelines(line + "\n" for line in step_fit_line(result) + error_lines(result))
        return
    t = Table(title=title)
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*(Text(c) for c in r))  # Text: no rich markup inside values
    tty = getattr(file, "isatty", lambda: False)()
    # Off a terminal (a pipe, a log) rich would wrap at 80 columns; the table wants more.
    console = Console(file=file, width=None if tty else 180)
    console.print(t)
    for line in step_fit_line(result):
        console.print(Text(line))
    for line in error_lines(result):
        console.print(Text(line, style="red"))


def _finite(x):
    """JSON has no Infinity/NaN: write them as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def write_json(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(result), indent=2, allow_nan=False) + "\n")
    return path


def write_plots(result: dict, stem: Path) -> list[Path]:
    """`<stem>-latency.png` (percentiles of TTFT, TPOT, ITL, E2E), `<stem>-throughput.png`, and
    for a profiled run `<stem>-step-split.png` (a decode step's components per level)."""
    # The object API with an Agg canvas: no pyplot, no global backend switch, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    levels = result["levels"]
    xs = list(range(len(levels)))
    labels = [level_label(lv) for lv in levels]
    xlabel = "concurrency" if result["config"]["mode"] == "closed" else "request rate"
    title = f"{result['model']} | {result['config']['workload']['dataset']}"
    pcts = result["config"]["percentiles"]
    stem.parent.mkdir(parents=True, exist_ok=True)

    fig = Figure(figsize=(11, 8), layout="constrained")
    for ax, (key, name) in zip(fig.subplots(2, 2).flat, LATENCIES, strict=True):
        for p in pcts:
            ax.plot(
                xs,
                [_nan(lv[key].get(percentile_key(p))) for lv in levels],
                marker="o",
                label=f"p{p:g}",
            )
        ax.plot(
            xs,
            [_nan(lv[key].get("mean")) for lv in levels],
            linestyle="--",
            marker=".",
            label="mean",
        )
        _axes(ax, xs, labels, xlabel, f"{name} (ms)")
    fig.suptitle(f"Latency percentiles vs {xlabel} — {title}")
    latency = stem.with_name(stem.name + "-latency.png")
    FigureCanvasAgg(fig).print_png(str(latency))

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    tok, req = fig.subplots(1, 2)
    tok.plot(xs, [lv["output_throughput"] for lv in levels], marker="o", label="output tok/s")
    tok.plot(xs, [lv["total_token_throughput"] for lv in levels], marker="s", label="total tok/s")
    _axes(tok, xs, labels, xlabel, "tokens/s")
    req.plot(xs, [lv["request_throughput"] for lv in levels], marker="o", label="requests/s")
    if result["config"]["slo"]:
        req.plot(xs, [lv["goodput"] for lv in levels], marker="s", label="goodput (within SLO)")
    _axes(req, xs, labels, xlabel, "requests/s")
    fig.suptitle(f"Throughput vs {xlabel} — {title}")
    throughput = stem.with_name(stem.name + "-throughput.png")
    FigureCanvasAgg(fig).print_png(str(throughput))
    split = _split_plot(result, stem, xlabel, title)
    return [latency, throughput] + ([split] if split else [])


def _split_plot(result: dict, stem: Path, xlabel: str, title: str) -> Path | None:
    """Stacked bars: mean ms of each component of a profiled decode step, per level."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    levels = [lv for lv in result["levels"] if lv.get("step_split")]
    if not levels:
        return None
    names: list[str] = []
    for lv in levels:
        names += [n for n in lv["step_split"]["components"] if n not in names]
    xs = list(range(len(levels)))
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    bottom = [0.0] * len(levels)
    for name in names:
        ms = [lv["step_split"]["components"].get(name, {}).get("ms_mean", 0.0) for lv in levels]
        ax.bar(xs, ms, bottom=bottom, label=name)
        bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    labels = [f"{level_label(lv)}\nbatch {lv['step_split']['batch_mean']:.1f}" for lv in levels]
    _axes(ax, xs, labels, xlabel, "ms per profiled decode step")
    fig.suptitle(f"Where a decode step goes — {title}")
    path = stem.with_name(stem.name + "-step-split.png")
    FigureCanvasAgg(fig).print_png(str(path))
    return path


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


def _axes(ax, xs: list[int], labels: list[str], xlabel: str, ylabel: str) -> None:
    ax.set_xticks(xs, labels)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
