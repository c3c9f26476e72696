"""What the bench family of commands share (`kvrelay bench`, `ab`, `verify`, `repro`): the help
format, the workload arguments and their label, and the progress display."""

from __future__ import annotations

import argparse
import sys
import time

from kvrelay.bench.loadgen import BenchError, Progress
from kvrelay.bench.workloads import CHAT, COMPLETIONS, DATASETS, WorkloadConfig


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None/False ones (those flags say in words what happens without them)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


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
