"""`kvrelay bench`: its flags (named as in `vllm bench serve` / `sglang.bench_serving` where they
overlap) and the command, which prints a table and writes JSON and PNG plots."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path

from kvrelay.bench import metrics as bm
from kvrelay.bench.cli_shared import (
    HelpFormatter,
    RichProgress,
    add_workload_args,
    workload_from_args,
    workload_label,
)
from kvrelay.bench.loadgen import BenchConfig, BenchError, Progress, run_sweep
from kvrelay.ledger.cli import add_ledger_arg, save_run

DEFAULT_CONCURRENCY = "1,8,32,64"


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    b = subparsers.add_parser(
        "bench",
        formatter_class=HelpFormatter,
        help="load-test a running server over HTTP: latency, throughput, goodput",
        description="Streams requests to an OpenAI-compatible server at closed-loop concurrency levels "
        "or open-loop request rates; reports TTFT, TPOT, ITL and end-to-end latency, "
        "throughput and goodput per level, and checks them against the server's /metrics.",
    )
    g = b.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1", help="server host, when --base-url is not given")
    g.add_argument(
        "--port", type=int, default=8000, help="server port, when --base-url is not given"
    )
    g.add_argument(
        "--model", default=None, help="model name to request (default: the first the server lists)"
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds before a request counts as failed",
    )

    add_workload_args(b)

    g = b.add_argument_group("load")
    g.add_argument(
        "--concurrency",
        default=None,
        help=f"closed loop: comma-separated numbers of users, each sending its next request when "
        f"its last one ends (default {DEFAULT_CONCURRENCY})",
    )
    g.add_argument(
        "--request-rate",
        default=None,
        help="open loop: comma-separated arrival rates in requests/s (new sessions/s for multi-turn "
        "workloads); 'inf' sends all at once",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="open loop: gamma shape of inter-arrival times (1: Poisson; lower: burstier)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="open loop: cap on requests in flight (alone: --request-rate inf with this cap, as vLLM)",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per level (default: 5x concurrency, at least 16; 64 in open loop)",
    )
    g.add_argument(
        "--num-warmups", type=int, default=1, help="short requests sent before the first level"
    )
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")

    g = b.add_argument_group("metrics and output")
    g.add_argument(
        "--slo",
        "--goodput",
        dest="slo",
        nargs="+",
        default=None,
        metavar="KEY=MS",
        help="goodput SLOs in ms, e.g. 'ttft=500,tpot=50' or vLLM's 'ttft:500 tpot:50' (keys: "
        + ", ".join(bm.SLO_KEYS)
        + ")",
    )
    g.add_argument(
        "--metric-percentiles", default="50,90,99", help="comma-separated percentiles to report"
    )
    g.add_argument(
        "--metrics-interval",
        type=float,
        default=0.5,
        help="seconds between polls of the server's gauges during a level (0: off)",
    )
    g.add_argument(
        "--step-profile-every",
        type=int,
        default=None,
        metavar="N",
        help="have the server split every N-th engine step into attention / mlp or moe / "
        "communication / other during the run (restored afterwards); default: leave the "
        "server's setting",
    )
    g.add_argument("--result-dir", default="bench-results", help="where the JSON and PNG files go")
    g.add_argument(
        "--result-filename",
        default=None,
        help="JSON file name (default kvrelay-bench-DATASET-MODE-TIMESTAMP.json); plots share its stem",
    )
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="also store every request's timings in the JSON",
    )
    g.add_argument("--no-save", action="store_true", help="print the table only; write no files")
    g.add_argument("--no-plots", action="store_true", help="write the JSON but no PNG plots")
    g.add_argument(
        "--disable-progress",
        "--disable-tqdm",
        dest="disable_progress",
        action="store_true",
        help="no progress bar",
    )
    add_ledger_arg(g)
    b.set_defaults(func=cmd_bench)
    # verify, ab and the ledger's report ride along: the top-level CLI needs no wiring of its own.
    from kvrelay.bench.ab import add_ab_parser
    from kvrelay.bench.verify import add_verify_parser
    from kvrelay.ledger.cli import add_report_parser

    add_verify_parser(subparsers)
    add_ab_parser(subparsers)
    add_report_parser(subparsers)
    return b


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{what}: {text!r} is not a comma-separated list of numbers") from None
    if not values:
        raise BenchError(f"{what} is empty")
    return values


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    wl = workload_from_args(a)
    try:
        slo = bm.parse_slo(" ".join(a.slo)) if a.slo else {}
    except ValueError as e:
        raise BenchError(str(e)) from None
    if a.concurrency and a.request_rate:
        raise BenchError(
            "--concurrency (closed loop) and --request-rate (open loop) exclude each other"
        )
    concurrency: list[float] = []
    rates: list[float] = []
    if a.request_rate:
        rates = _floats(a.request_rate, "--request-rate")
    elif a.max_concurrency and not a.concurrency:
        rates = [math.inf]
    else:
        concurrency = _floats(a.concurrency or DEFAULT_CONCURRENCY, "--concurrency")
        if any(c != int(c) for c in concurrency):
            raise BenchError("--concurrency takes whole numbers")
    if a.max_concurrency is not None and concurrency:
        raise BenchError(
            "--max-concurrency applies to open loop (--request-rate); use --concurrency alone"
        )
    return BenchConfig(
        base_url=a.base_url or f"http://{a.host}:{a.port}",
        workload=wl,
        model=a.model,
        concurrency=tuple(int(c) for c in concurrency),
        request_rates=tuple(rates),
        burstiness=a.burstiness,
        max_concurrency=a.max_concurrency,
        num_prompts=a.num_prompts,
        num_warmups=a.num_warmups,
        seed=a.seed,
        slo=slo,
        percentiles=tuple(_floats(a.metric_percentiles, "--metric-percentiles")),
        request_timeout_s=a.request_timeout,
        metrics_interval_s=a.metrics_interval,
        save_detailed=a.save_detailed,
        step_profile_every=a.step_profile_every,
    )


def cmd_bench(a: argparse.Namespace) -> int:
    """Exit 0: every request succeeded; 1: some failed (results still written); 2: could not run."""
    from kvrelay.bench import report

    started = time.time()
    try:
        cfg = config_from_args(a)
        result = asyncio.run(run_sweep(cfg, Progress() if a.disable_progress else RichProgress()))
    except BenchError as e:
        sys.stderr.write(f"kvrelay bench: {e}\n")
        return 2
    report.print_table(result, sys.stdout)
    if not a.no_save:
        name = a.result_filename or time.strftime(
            f"kvrelay-bench-{cfg.workload.dataset}-{cfg.mode}-%Y%m%d-%H%M%S.json"
        )
        path = Path(a.result_dir) / name
        stem = path.with_suffix("") if path.suffix == ".json" else path
        written = []
        if not a.no_plots:
            try:
                written = report.write_plots(result, stem)
            except ImportError as e:  # the JSON still gets written
                sys.stderr.write(f"kvrelay bench: no plots ({e}); pip install matplotlib\n")
        result["plots"] = [str(p) for p in written]
        written.insert(0, report.write_json(result, stem.with_name(stem.name + ".json")))
        sys.stdout.write("wrote " + ", ".join(str(p) for p in written) + "\n")
    save_run(
        a,
        "bench",
        result["config"],
        result,
        server_url=cfg.base_url,
        workload=f"{workload_label(cfg.workload)} {_levels_label(cfg)}",
        headline=bench_headline(result),
        started_at=started,
        status="errors" if result["totals"]["failed"] else "ok",
    )
    if result["totals"]["counters_agree"] is False:
        sys.stdout.write(
            "warning: the server's /metrics counters differ from the bench's counts "
            "(another client on the server, or a counting bug)\n"
        )
    return 1 if result["totals"]["failed"] else 0


def _levels_label(cfg: BenchConfig) -> str:
    if cfg.mode == "closed":
        return "c=" + ",".join(str(c) for c in cfg.concurrency)
    rates = ",".join(f"{r:g}" for r in cfg.request_rates)
    return f"rate={rates}/s" + (f" max_c={cfg.max_concurrency}" if cfg.max_concurrency else "")


def bench_headline(result: dict) -> str:
    """Per level: output tok/s, mean TTFT and TPOT; then the step-time model (ledger report)."""
    from kvrelay.bench.report import level_label
    from kvrelay.bench.stepfit import describe

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    parts = [
        f"{level_label(lv)}: {lv['output_throughput']:.1f} tok/s, TTFT {ms(lv['ttft_ms']['mean'])} ms, "
        f"TPOT {ms(lv['tpot_ms']['mean'])} ms"
        + (
            f", {lv['failed']} failed ({bm.describe_causes(lv.get('failure_causes') or {})})"
            if lv["failed"]
            else ""
        )
        for lv in result["levels"]
    ]
    if result.get("step_fit"):
        parts.append(describe(result["step_fit"]))
    return "; ".join(parts)
