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
from kvrelay.bench.loadgen import BenchConfig, BenchError, Progress, run_sweep
from kvrelay.bench.workloads import CHAT, COMPLETIONS, DATASETS, WorkloadConfig
from kvrelay.ledger.cli import add_ledger_arg, save_run

DEFAULT_CONCURRENCY = "1,8,32,64"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None/False ones (those flags say in words what happens without them)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    b = subparsers.add_parser(
        "bench",
        formatter_class=_HelpFormatter,
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


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """What is sent: shared by `kvrelay bench` and `kvrelay ab`."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--endpoint",
        default=None,
        choices=[COMPLETIONS, CHAT],
        help=f"API route (default: {COMPLETIONS} for random, {CHAT} for the chat workloads)",
    )
    g.add_argument(
        "--dataset-name",
        default="random",
        choices=DATASETS,
        help="random: fixed-length prompts; shared-prefix-chat: multi-turn chats sharing system "
        "prompts; agentic: tool-call loops with simulated tools",
    )
    g.add_argument(
        "--input-len",
        "--random-input-len",
        dest="input_len",
        type=int,
        default=1024,
        help="prompt tokens (random), tokens per user turn (chat) or of the task (agentic)",
    )
    g.add_argument(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=int,
        default=128,
        help="max_tokens of every request",
    )
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [len*(1-r), len*(1+r)]",
    )
    g.add_argument(
        "--prefix-len",
        "--gsp-system-prompt-len",
        dest="prefix_len",
        type=int,
        default=1024,
        help="chat/agentic: tokens of the system prompt a group of sessions shares",
    )
    g.add_argument(
        "--num-prefix-groups",
        "--gsp-num-groups",
        dest="num_prefix_groups",
        type=int,
        default=4,
        help="chat/agentic: number of distinct shared system prompts",
    )
    g.add_argument("--num-turns", type=int, default=4, help="chat/agentic: requests per session")
    g.add_argument(
        "--tool-result-len",
        type=int,
        default=256,
        help="agentic: tokens of each simulated tool result",
    )
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly --output-len tokens",
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{what}: {text!r} is not a comma-separated list of numbers") from None
    if not values:
        raise BenchError(f"{what} is empty")
    return values


def workload_from_args(a: argparse.Namespace) -> WorkloadConfig:
    endpoint = a.endpoint or (COMPLETIONS if a.dataset_name == "random" else CHAT)
    try:
        return WorkloadConfig(
            dataset=a.dataset_name,
            endpoint=endpoint,
            input_len=a.input_len,
            output_len=a.output_len,
            range_ratio=a.random_range_ratio,
            prefix_len=a.prefix_len,
            num_prefix_groups=a.num_prefix_groups,
            num_turns=a.num_turns,
            tool_result_len=a.tool_result_len,
            ignore_eos=a.ignore_eos,
            temperature=a.temperature,
        )
    except ValueError as e:
        raise BenchError(str(e)) from None


def workload_label(wl: WorkloadConfig) -> str:
    """The workload in one line, for the ledger: 'random in=256 out=64'."""
    label = f"{wl.dataset} in={wl.input_len} out={wl.output_len}"
    if wl.dataset != "random":
        label += f" prefix={wl.prefix_len} turns={wl.num_turns}"
    return (
        label
        + ("" if wl.ignore_eos else " eos")
        + (f" T={wl.temperature:g}" if wl.temperature else "")
    )


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


class RichProgress(Progress):
    """A progress bar per level on stderr (rich), or one line per level without rich."""

    def __init__(self) -> None:
        try:
            import rich.progress as rp
        except ImportError:
            rp = None
        self.rp, self.bar, self.task = rp, None, None
        self.failed, self.label, self.t0 = 0, "", 0.0

    def start_level(self, label: str, total: int) -> None:
        self.failed, self.label, self.t0 = 0, label, time.perf_counter()
        if self.rp is not None:
            rp = self.rp
            # A fresh bar per level: a finished level stays on screen as one line.
            self.bar = rp.Progress(
                rp.TextColumn("{task.description}"),
                rp.BarColumn(),
                rp.MofNCompleteColumn(),
                rp.TextColumn("failed {task.fields[failed]}"),
                rp.TimeElapsedColumn(),
            )
            self.bar.start()
            self.task = self.bar.add_task(label, total=total, failed=0)

    def request_done(self, record) -> None:
        self.failed += not record.success
        if self.bar is not None:
            self.bar.update(self.task, advance=1, failed=self.failed)

    def end_level(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        else:
            elapsed = time.perf_counter() - self.t0
            sys.stderr.write(f"{self.label}: done in {elapsed:.1f}s, {self.failed} failed\n")


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
