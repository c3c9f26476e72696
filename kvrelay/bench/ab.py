"""`kvrelay ab`: A/B of two server configurations. The same bench level (one concurrency, the same
prompts per trial) runs on A, then B, for each of --trials trials (or, with --order abba, B first
in every other trial, which cancels a drift that is linear in time); the relative difference of a
metric, paired by trial, gets a t confidence interval and a verdict such as
"B is +12.8% ± 2.1% output tok/s at concurrency 64". Either side is a URL or a `kvrelay serve`
command line that ab starts (both run at once: give each its share of the device).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvrelay.bench.confidence import LEVELS, paired_relative_difference
from kvrelay.bench.loadgen import BenchConfig, BenchError, Progress, run_sweep
from kvrelay.bench.workloads import WorkloadConfig

SCHEMA = "kvrelay-ab/1"

# name -> (what it is, higher is better, its value in a bench level)
METRICS = {
    "output_throughput": ("output tok/s", True, lambda lv: lv["output_throughput"]),
    "total_token_throughput": ("total tok/s", True, lambda lv: lv["total_token_throughput"]),
    "request_throughput": ("requests/s", True, lambda lv: lv["request_throughput"]),
    "ttft": ("mean TTFT", False, lambda lv: lv["ttft_ms"]["mean"]),
    "tpot": ("mean TPOT", False, lambda lv: lv["tpot_ms"]["mean"]),
    "itl": ("mean ITL", False, lambda lv: lv["itl_ms"]["mean"]),
    "e2el": ("mean E2E latency", False, lambda lv: lv["e2el_ms"]["mean"]),
}


@dataclass(frozen=True)
class ABConfig:
    url_a: str
    url_b: str
    workload: WorkloadConfig
    concurrency: int = 64
    trials: int = 5
    num_prompts: int | None = None  # per trial and side; None: 5x concurrency (at least 16)
    metric: str = "output_throughput"
    confidence: float = 0.95
    model: str | None = None
    seed: int = 0
    num_warmups: int = 1  # before each side's first trial
    request_timeout_s: float = 600.0
    order: str = "ab"  # ab: A then B in every trial; abba: B first in odd trials

    def bench(self, side: str, trial: int) -> BenchConfig:
        """One trial of one side: a single closed-loop level; A and B of a trial share its prompts."""
        return BenchConfig(
            base_url=self.url_a if side == "a" else self.url_b,
            workload=self.workload,
            model=self.model,
            concurrency=(self.concurrency,),
            num_prompts=self.num_prompts,
            num_warmups=self.num_warmups if trial == 0 else 0,
            seed=self.seed + trial,
            request_timeout_s=self.request_timeout_s,
            metrics_interval_s=0,
        )


async def run_trials(cfg: ABConfig, progress: Progress | None = None) -> list[dict]:
    """A then B, trial after trial: what drifts over time hits both sides of a pair alike (with
    order abba, B goes first in odd trials: a steady drift then favours neither side)."""
    trials = []
    for i in range(cfg.trials):
        sides = ("b", "a") if cfg.order == "abba" and i % 2 else ("a", "b")
        pair: dict = {"trial": i, "order": "".join(sides)}
        for side in sides:
            result = await run_sweep(cfg.bench(side, i), progress)
            (level,) = result["levels"]
            pair[side] = {
                "failed": level["failed"],
                "completed": level["completed"],
                "duration_s": level["duration_s"],
                "step_fit": level.get("step_fit"),
                **{m: get(level) for m, (_, _, get) in METRICS.items()},
            }
        trials.append(pair)
    return trials


def analyse(cfg: ABConfig, trials: list[dict]) -> dict:
    """The paired relative difference of every metric that both sides measured in every trial."""
    out = {}
    for m in METRICS:
        a = [t["a"][m] for t in trials]
        b = [t["b"][m] for t in trials]
        if any(x is None or x <= 0 for x in a) or any(y is None for y in b):
            out[m] = None
            continue
        out[m] = paired_relative_difference(a, b, cfg.confidence)
    return out


def verdict(metric: str, diff: dict | None, concurrency: int) -> str:
    """'B is +12.8% ± 2.1% output tok/s at concurrency 64 (better)', or 'no significant difference (…)'."""
    label, higher_better, _ = METRICS[metric]
    where = f"{label} at concurrency {concurrency}"
    if diff is None:
        return f"no result: {label} was not measured in every trial (failed requests?)"
    pct = f"{diff['mean'] * 100:+.1f}%"
    if diff["half_width"] is None:
        return f"B is {pct} {where} (one trial: no confidence interval)"
    text = f"B is {pct} ± {diff['half_width'] * 100:.1f}% {where}"
    if not diff["significant"]:
        ci = f"{diff['confidence']:.0%} CI contains 0"
        return f"no significant difference ({text}; {ci})"
    better = (diff["mean"] > 0) == higher_better
    return f"{text} ({'better' if better else 'worse'})"


async def run_ab(cfg: ABConfig, progress: Progress | None = None) -> dict:
    if cfg.trials < 1 or cfg.concurrency < 1:
        raise BenchError("--trials and --concurrency must be at least 1")
    if cfg.order not in ("ab", "abba"):
        raise BenchError("--order must be ab or abba")
    if cfg.metric not in METRICS:
        raise BenchError(f"--metric must be one of {', '.join(METRICS)}")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    trials = await run_trials(cfg, progress)
    diffs = analyse(cfg, trials)
    return {
        "schema": SCHEMA,
        "created": started,
        "config": asdict(cfg),
        "trials": trials,
        "differences": diffs,
        "verdict": verdict(cfg.metric, diffs[cfg.metric], cfg.concurrency),
        "failed": sum(t[s]["failed"] for t in trials for s in ("a", "b")),
    }


# --- output -----------------------------------------------------------------------------------------


def print_report(result: dict, out) -> None:
    cfg = result["config"]
    out.write(f"A: {cfg['url_a']}\nB: {cfg['url_b']}\n")
    if result.get("change"):
        out.write(f"B changes: {result['change']}\n")
    m = cfg["metric"]
    label = METRICS[m][0]
    out.write(
        f"{'trial':>5}  {'order':>5}  {'A ' + label:>18}  {'B ' + label:>18}  {'B/A - 1':>8}\n"
    )
    d = result["differences"][m]
    for i, t in enumerate(result["trials"]):
        rel = "-" if d is None else f"{d['per_trial'][i] * 100:+.1f}%"
        order = t.get("order", "ab").upper()
        out.write(
            f"{t['trial']:>5}  {order:>5}  {_num(t['a'][m]):>18}  {_num(t['b'][m]):>18}  {rel:>8}\n"
        )
    for name, diff in result["differences"].items():
        if name == m or diff is None:
            continue
        hw = "" if diff["half_width"] is None else f" ± {diff['half_width'] * 100:.1f}%"
        sig = "*" if diff["significant"] else ""
        out.write(f"  {METRICS[name][0]}: B {diff['mean'] * 100:+.1f}%{hw}{sig}\n")
    if result["failed"]:
        out.write(f"warning: {result['failed']} requests failed\n")
    out.write(f"verdict: {result['verdict']}\n")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


# --- CLI --------------------------------------------------------------------------------------------


def add_ab_parser(subparsers) -> argparse.ArgumentParser:
    from kvrelay.bench.cli_shared import HelpFormatter, add_workload_args
    from kvrelay.ledger.cli import add_ledger_arg

    p = subparsers.add_parser(
        "ab",
        formatter_class=HelpFormatter,
        help="A/B two server configurations: alternating trials, a confidence interval, a verdict",
        description="Runs the same closed-loop bench level on A and then B, --trials times, and "
        "reports B's relative difference in --metric with a confidence interval (paired by "
        "trial, Student's t). Each side is a running server (--a-url) or a `kvrelay serve` "
        "command line to start (--a-serve='--attention-backend torch'); started servers run "
        "at the same time, so give each its share of the device. --decide records an "
        "accept/reject decision with its evidence in the ledger (`kvrelay report`). "
        "Exit 0: done; 1: some requests failed; 2: could not run.",
    )
    g = p.add_argument_group("the two configurations")
    for side in ("a", "b"):
        s = side.upper()
        g.add_argument(f"--{side}-url", default=None, help=f"{s}: a running server's URL")
        g.add_argument(
            f"--{side}-serve",
            default=None,
            metavar="ARGS",
            help=f"{s}: arguments of a `kvrelay serve` that ab starts (on a free port) and stops; "
            f"write --{side}-serve='ARGS' when ARGS start with a dash",
        )
    g.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds for a started server to be up"
    )
    g.add_argument(
        "--model", default=None, help="model name to request (default: each server's first)"
    )
    g.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before a request fails"
    )
    add_workload_args(p)
    g = p.add_argument_group("trials")
    g.add_argument("--concurrency", type=int, default=64, help="closed-loop users of every trial")
    g.add_argument("--trials", type=int, default=5, help="A/B pairs to run")
    g.add_argument(
        "--order",
        choices=["ab", "abba"],
        default="ab",
        help="ab: A then B in every trial; abba: B first in every other trial (cancels a "
        "linear drift, e.g. a device warming up)",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per trial and side (default: 5x concurrency, at least 16)",
    )
    g.add_argument("--num-warmups", type=int, default=1, help="warm-up requests per side")
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts (trial i: seed + i)")
    g.add_argument(
        "--metric", default="output_throughput", choices=list(METRICS), help="what decides"
    )
    g.add_argument(
        "--confidence", type=float, default=0.95, choices=LEVELS, help="confidence level"
    )
    g = p.add_argument_group("decision and output")
    g.add_argument(
        "--decide",
        choices=["accept", "reject"],
        default=None,
        help="record this decision on B's change in the ledger (needs --reason)",
    )
    g.add_argument("--reason", default=None, help="why (shown in `kvrelay report`)")
    g.add_argument(
        "--change",
        default=None,
        help="what B changes (default: the settings where B's /server_info differs from A's)",
    )
    g.add_argument("--result-dir", default="bench-results", help="where the JSON (and logs) go")
    g.add_argument(
        "--result-filename", default=None, help="JSON file name (default kvrelay-ab-TIMESTAMP.json)"
    )
    g.add_argument("--no-save", action="store_true", help="write no JSON file")
    g.add_argument("--disable-progress", action="store_true", help="no progress bar")
    add_ledger_arg(g)
    p.set_defaults(func=cmd_ab)
    return p


def cmd_ab(a: argparse.Namespace) -> int:
    from kvrelay.bench.cli_shared import RichProgress, workload_from_args
    from kvrelay.ledger import store

    try:
        for side in ("a", "b"):
            if (getattr(a, f"{side}_url") is None) == (getattr(a, f"{side}_serve") is None):
                raise BenchError(f"give exactly one of --{side}-url and --{side}-serve")
        if a.decide and not a.reason:
            raise BenchError("--decide needs --reason")
        if a.decide and store.resolve_path(a.ledger) is None:
            raise BenchError("--decide needs a ledger (it is off)")
        cfg = ABConfig(
            url_a="",
            url_b="",
            workload=workload_from_args(a),
            concurrency=a.concurrency,
            trials=a.trials,
            num_prompts=a.num_prompts,
            metric=a.metric,
            confidence=a.confidence,
            model=a.model,
            seed=a.seed,
            num_warmups=a.num_warmups,
            request_timeout_s=a.request_timeout,
            order=a.order,
        )
    except BenchError as e:
        sys.stderr.write(f"kvrelay ab: {e}\n")
        return 2
    started = time.time()
    progress = Progress() if a.disable_progress else RichProgress()
    with _servers(a) as urls:
        if urls is None:
            return 2
        cfg = replace(cfg, url_a=urls[0], url_b=urls[1])
        try:
            result = asyncio.run(run_ab(cfg, progress))
        except BenchError as e:
            sys.stderr.write(f"kvrelay ab: {e}\n")
            return 2
        _describe_sides(a, cfg, result)
        print_report(result, sys.stdout)
        if not a.no_save:
            from kvrelay.bench import report

            name = a.result_filename or time.strftime("kvrelay-ab-%Y%m%d-%H%M%S.json")
            sys.stdout.write(f"wrote {report.write_json(result, Path(a.result_dir) / name)}\n")
        _record(a, cfg, result, started)  # while started servers still answer /server_info
    return 1 if result["failed"] else 0


def _describe_sides(a: argparse.Namespace, cfg: ABConfig, result: dict) -> None:
    """Both servers' /server_info and what B changes, into the result (while they still run)."""
    from kvrelay.ledger.configs import config_diff
    from kvrelay.ledger.record import fetch_server_info

    info = {"a": fetch_server_info(cfg.url_a), "b": fetch_server_info(cfg.url_b)}
    result["server_info"] = info
    result["serve_args"] = {"a": a.a_serve, "b": a.b_serve}
    result["change"] = (
        a.change or config_diff(info["a"], info["b"]) or "no difference in /server_info"
    )


def _record(a: argparse.Namespace, cfg: ABConfig, result: dict, started: float) -> None:
    """Into the ledger under B's configuration, with the decision, if any."""
    from kvrelay.bench.cli_shared import workload_label
    from kvrelay.ledger.cli import save_run
    from kvrelay.ledger.store import Decision

    decision = None
    if a.decide:
        decision = Decision(a.decide, result["change"], a.reason, result["verdict"])
    save_run(
        a,
        "ab",
        result["config"],
        result,
        server_info=result["server_info"]["b"],
        workload=f"{workload_label(cfg.workload)} c={cfg.concurrency} x{cfg.trials} [{cfg.metric}]",
        headline=f"{result['verdict']} [{result['change']}]",
        started_at=started,
        status="errors" if result["failed"] else "ok",
        decision=decision,
    )


@contextmanager
def _servers(a: argparse.Namespace) -> Iterator[tuple[str, str] | None]:
    """The two sides' URLs; sides given as `kvrelay serve` arguments are started (in parallel)
    and always stopped at the end. None (after saying why) when one does not come up."""
    from kvrelay.ops.launcher import LaunchError
    from kvrelay.ops.serve_child import ServeChild

    children: list[ServeChild] = []
    try:
        urls: list[str] | None = []
        try:
            for side in ("a", "b"):
                args = getattr(a, f"{side}_serve")
                if args is None:
                    urls.append(getattr(a, f"{side}_url").rstrip("/"))
                    continue
                log = Path(a.result_dir) / f"ab-server-{side}.log"
                children.append(ServeChild(shlex.split(args), log))
                urls.append(children[-1].url)
            for child in children:
                child.wait_healthy(a.start_timeout)
        except LaunchError as e:
            sys.stderr.write(f"kvrelay ab: {e}\n")
            urls = None
        yield None if urls is None else (urls[0], urls[1])
    finally:
        for child in children:
            child.stop()
