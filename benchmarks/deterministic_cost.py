"""The throughput cost of `--deterministic` (batch-invariant mode) on the CPU: SmolLM2 through the
engine in this process, with and without the mode, alternating (A B B A ...) so a drift in the
machine's load hits both. Prefill: `--batch` prompts of `--prompt-len` random tokens, one output
token each; decode: the same prompts then `--decode-tokens` more tokens, the decode time being the
difference. Greedy, ignore_eos, prefix cache off (every trial computes the same work). Time is
this process's CPU time (both torch threads), not wall time: the machine is shared.

    nice python benchmarks/deterministic_cost.py --out benchmarks/results/deterministic_cost_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams


def engine(a: argparse.Namespace, deterministic: bool) -> Engine:
    cfg = EngineConfig(
        model=a.model,
        dtype=a.dtype,
        device="cpu",
        deterministic=deterministic,
        cache=CacheConfig(max_total_tokens=8192, prefix_cache=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens),
    )
    return Engine(cfg)


def timed(eng: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """CPU seconds of this process (all torch threads) to run the prompts: on a machine shared
    with other jobs, wall time measures their load more than this work."""
    p = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.process_time()
    generate(eng, prompts, p)
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", default="1,8", help="concurrent requests per level")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    engines = {"default": engine(a, False), "deterministic": engine(a, True)}
    g = torch.Generator().manual_seed(0)
    levels = {}
    for b in (int(x) for x in a.batch.split(",")):
        prompts = [
            torch.randint(100, 40000, (a.prompt_len,), generator=g).tolist() for _ in range(b)
        ]
        for eng in engines.values():  # warm-up
            timed(eng, prompts[:1], 2)
        t = {name: {"prefill_s": [], "full_s": []} for name in engines}
        for trial in range(a.trials):
            order = list(engines) if trial % 2 == 0 else list(engines)[::-1]
            for name in order:
                t[name]["prefill_s"].append(timed(engines[name], prompts, 1))
                t[name]["full_s"].append(timed(engines[name], prompts, 1 + a.decode_tokens))
        level = {}
        for name, v in t.items():
            # best of the trials: other jobs on the machine only ever add time
            pre, full = min(v["prefill_s"]), min(v["full_s"])
            level[name] = {
                "prefill_tok_per_cpu_s": b * a.prompt_len / pre,
                "decode_tok_per_cpu_s": b * a.decode_tokens / max(full - pre, 1e-6),
                **v,
            }
        d, n = level["default"], level["deterministic"]
        level["deterministic_over_default"] = {
            "prefill": n["prefill_tok_per_cpu_s"] / d["prefill_tok_per_cpu_s"],
            "decode": n["decode_tok_per_cpu_s"] / d["decode_tok_per_cpu_s"],
        }
        levels[str(b)] = level
        print(f"batch {b}: " + json.dumps(level["deterministic_over_default"]), flush=True)
    result = {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": "cpu",
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "args": vars(a),
            "note": "shared 2-core machine (other jobs ran beside it): throughput per CPU second "
            "of this process (process_time), best of the trials; decode = (prefill + decode) - prefill",
        },
        "levels": levels,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result["levels"], indent=1))


if __name__ == "__main__":
    main()
