"""Where a DeepSeek-V4 fast-path decode step spends its GPU time: the step run eagerly under
torch.profiler (kernel names and counts; GPU time per kernel is the same inside a graph), next
to the graphed step's wall time, so launch gaps (graph time minus summed kernel time) show too.

    python benchmarks/dsv4_profile.py --batches 1,64 --out bench-results/dsv4_profile.json
CPU dry run: python benchmarks/dsv4_profile.py --model dsv4-tiny --device cpu --batches 1 \
                 --context 64
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from dsv4_decode import fake_requests, make_engine, randomize_pools, release, sync
from torch.profiler import ProfilerActivity, profile

from kvrelay.engine.scheduler import ScheduledRequest


def _kernel_table(prof, steps: int) -> tuple[list[dict], int, float]:
    """Device kernels grouped by name: us per step and launches per step."""
    us: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name] += e.device_time
            count[e.name] += 1
    rows = [
        {"kernel": k[:90], "us_per_step": us[k] / steps, "launches_per_step": count[k] / steps}
        for k in sorted(us, key=us.get, reverse=True)
    ]
    return rows, sum(count.values()) // steps, sum(us.values()) / steps


# kernel name -> component of the step split (first match wins; the rest is "other")
COMPONENTS = (
    ("moe", ("_gate_up_kernel", "_down_kernel", "_group_kernel")),
    ("attention", ("_sparse_split_kernel", "_sparse_combine_kernel", "_score_kernel",
                   "_select_kernel", "_pool_windows_kernel")),
    ("mhc", ("_hc_mix_kernel", "_hc_finish_kernel")),  # finish includes the norm after it
    ("norms", ("_rms_norm_wide_kernel",)),
    ("gemm", ("nvjet", "gemm", "gemv", "splitKreduce", "dot_kernel", "cutlass")),
)  # fmt: skip


def component_split(rows: list[dict]) -> dict[str, float]:
    """us per step by component, from the kernel table."""
    out = {name: 0.0 for name, _ in COMPONENTS} | {"other": 0.0}
    for r in rows:
        name = next((c for c, keys in COMPONENTS if any(k in r["kernel"] for k in keys)), "other")
        out[name] += r["us_per_step"]
    return out


def fit_lines(results: list[dict]) -> dict[str, tuple[float, float]]:
    """Per component (and the graphed step), least-squares ms = a + b * batch."""
    xs = [float(r["batch"]) for r in results]
    series = {
        c: [r["components_us"][c] / 1e3 for r in results] for c in results[0]["components_us"]
    }
    series["graphed_step"] = [r["graphed_step_ms"] for r in results]
    n, mx = len(xs), sum(xs) / len(xs)
    out = {}
    for name, ys in series.items():
        my = sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
        out[name] = (my - b * mx, b)
    return out


def _source_table(prof, steps: int) -> list[dict]:
    """Kernel time and launches per step by (op, the innermost kvrelay source line that ran
    it): which lines of the model launch the small kernels."""
    us: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for e in prof.events():
        kernels = getattr(e, "kernels", None)
        if not kernels:
            continue
        frames = [f for f in (e.stack or []) if "kvrelay" in f]
        key = f"{e.name} @ {frames[0].split('kvrelay/')[-1] if frames else '?'}"
        us[key] += sum(k.duration for k in kernels)
        count[key] += len(kernels)
    return [
        {"source": k, "us_per_step": us[k] / steps, "launches_per_step": count[k] / steps}
        for k in sorted(count, key=count.get, reverse=True)
    ]


def profile_batch(engine, batch: int, ctx: int, steps: int, device: str) -> dict:
    reqs, shared = fake_requests(engine, batch, ctx)
    sched = [ScheduledRequest(q, 1) for q in reqs]
    runner = engine.runner
    engine.runner.forward(sched)  # graph capture / warm-up
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        runner.forward(sched)
    sync(device)
    graphed_ms = (time.perf_counter() - t) * 1e3 / steps
    graphs, runner.graphs = runner.graphs, None  # the same kernels, launched one by one
    runner.forward(sched)
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts, with_stack=True) as prof:
        for _ in range(steps):
            runner.forward(sched)
        sync(device)
    runner.graphs = graphs
    release(engine, reqs, shared)
    rows, launches, kernel_us = _kernel_table(prof, steps)
    return {
        "batch": batch,
        "context": ctx,
        "graphed_step_ms": graphed_ms,
        "kernel_ms_per_step": kernel_us / 1e3,
        "launches_per_step": launches,
        "kernels": rows[:40],
        "components_us": component_split(rows),
        "sources": _source_table(prof, steps)[:60],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dsv4-mini")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--linear-weights", default="auto", choices=["auto", "fp8"])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    a.batches = [int(x) for x in a.batches.split(",")]
    a.contexts, a.prefill = [a.context], 256
    engine = make_engine(a, "auto")
    randomize_pools(engine)
    results = []
    for b in a.batches:
        r = profile_batch(engine, b, a.context, a.steps, a.device)
        results.append(r)
        print(
            f"batch {b}: graphed {r['graphed_step_ms']:.2f} ms, kernels {r['kernel_ms_per_step']:.2f}"
            f" ms in {r['launches_per_step']} launches"
        )
        for k in r["kernels"][:25]:
            print(f"  {k['us_per_step']:9.1f} us {k['launches_per_step']:6.1f}x  {k['kernel']}")
        print("  by source line (most launches first):")
        for k in r["sources"][:40]:
            print(f"  {k['launches_per_step']:6.1f}x {k['us_per_step']:9.1f} us  {k['source']}")
    lines = fit_lines(results) if len(results) > 1 else {}
    if lines:
        print("step split, ms = a + b * batch (kernel time; launch gaps only in graphed_step):")
        for name, (a0, b1) in lines.items():
            print(f"  {name:13s} a={a0:7.3f} b={b1:7.4f}")
    if a.out:
        out = {"model": a.model, "dtype": a.dtype, "results": results, "lines": lines}
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
