"""Which decode steps of an engine run eagerly instead of from a graph, and why: the plain
agent at concurrency 1 came out ~10x slower per token than at 8 on the H100 (2026-12-07).

    python scripts/dev_graph_miss.py MODEL_DIR [--dtype bfloat16] [--concurrency 1,8]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from agent_prompts import agent_prompts  # noqa: E402

from kvrelay.config import CacheConfig, EngineConfig  # noqa: E402
from kvrelay.engine.engine import Engine, generate  # noqa: E402
from kvrelay.engine.messages import SamplingParams  # noqa: E402
from kvrelay.models.deepseek_v4 import graphs as g  # noqa: E402

seen: collections.Counter = collections.Counter()
orig = g.Dsv4GraphRunner.can_run


def can_run(self, step, profile):
    ok = orig(self, step, profile)
    key = (
        "graph" if ok else "eager",
        len(step.counts), max(step.counts, default=0), step.n_sampled, len(step.rows),
        bool(step.all_rows), g.context_bucket(g._context(step), self.runner.page_size)
        if step.counts else 0, self.max_context, profile is not None,
    )  # fmt: skip
    seen[key] += 1
    return ok


g.Dsv4GraphRunner.can_run = can_run
try:  # every Triton compile, with its time: which kernels a new step shape compiles again
    import triton.compiler.compiler as tcc

    _compile = tcc.compile

    def timed_compile(src, *args, **kwargs):
        t0 = time.perf_counter()
        out = _compile(src, *args, **kwargs)
        name = getattr(getattr(src, "fn", None), "__name__", None) or str(src)[:60]
        print(f"  triton compile {name}: {(time.perf_counter() - t0) * 1e3:.0f} ms", flush=True)
        return out

    tcc.compile = timed_compile
    import triton.runtime.jit as tjit

    if hasattr(tjit, "compile"):
        tjit.compile = timed_compile
except ImportError:
    pass
p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--concurrency", default="1,8")
p.add_argument("--profile", action="store_true", help="the ops of each level's second run")
p.add_argument("--cprofile", action="store_true", help="the Python functions of that run")
a = p.parse_args()
eng = Engine(EngineConfig(model=a.model, load_format="auto", dtype=a.dtype,
                          max_cuda_graph_batch=64, cache=CacheConfig(max_total_tokens=64 * 1024)))  # fmt: skip
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
print("graphs:", eng.runner.graphs is not None, "max_model_len", eng.runner.max_model_len)
for c in [int(x) for x in a.concurrency.split(",")]:
    prompts = agent_prompts(c, 200, Path(a.model))
    for rep in range(2):
        seen.clear()
        prof = None
        if a.profile and rep == 1:  # where the time of a step that is not graphed goes
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        cprof = None
        if a.cprofile and rep == 1:  # time outside torch ops (the profiler saw ~10% of c1's)
            import cProfile

            cprof = cProfile.Profile()
            cprof.enable()
        t0 = time.perf_counter()
        generate(eng, prompts, params)
        dt = time.perf_counter() - t0
        if cprof is not None:
            import pstats

            cprof.disable()
            pstats.Stats(cprof).sort_stats("cumulative").print_stats(40)
        if prof is not None:
            prof.__exit__(None, None, None)
            ops = prof.key_averages()
            print(ops.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
            print(ops.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
        print(f"c{c} run {rep}: {dt * 1e3 / 64:.2f} ms/token")
        for k, v in sorted(seen.items(), key=lambda kv: -kv[1]):
            print("   ", v, "(path, bs, q, n_sampled, rows, all_rows, ctx, max_ctx, profile) =", k)
