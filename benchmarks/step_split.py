"""Where a decode step's time goes: starts `kvrelay serve` (dummy weights; CUDA graphs on a GPU),
drives it with `kvrelay bench --step-profile-every N`, and tabulates per concurrency level the
split of the profiled decode steps (CUDA events, as nodes inside the CUDA graphs) into
attention / MLP or MoE / communication / other, each component's line over batch size, and the
step-time fit of the steps that were not profiled.

    python benchmarks/step_split.py --out bench-results/step_split.json
    python benchmarks/step_split.py --model dsv4-mini --concurrency 1,8 --output-len 16 \\
        --prompts-per-level 1 --tokenizer DIR
CPU dry run:  python benchmarks/step_split.py --model smollm2-135m --concurrency 1,2 \\
                  --input-len 64 --output-len 8 --prompts-per-level 2 --every 2
"""

from __future__ import annotations

import argparse
import json
import tempfile

from pd_vs_single import bench, meta, start, stop  # same directory: one way to run a server


def summarise(res: dict) -> dict:
    levels = []
    for lv in res["levels"]:
        fit = lv.get("step_fit") or {}
        levels.append(
            {
                "concurrency": lv["concurrency"],
                "completed": lv["completed"],
                "output_tok_s": lv["output_throughput"],
                "tpot_ms_mean": lv["tpot_ms"]["mean"],
                "unprofiled_fit": fit,
                "split": lv.get("step_split"),
            }
        )
        sp, b = lv.get("step_split"), fit.get("b_ms_per_seq")
        if sp and fit.get("a_ms") is not None:  # what a step of that batch takes unprofiled
            levels[-1]["unprofiled_ms_at_batch"] = fit["a_ms"] + (b or 0) * sp["batch_mean"]
    return {"levels": levels, "step_fit": res.get("step_fit"), "split": res.get("step_split")}


def print_table(s: dict) -> None:
    names = []
    for lv in s["levels"]:
        for n in (lv["split"] or {}).get("components", {}):
            if n not in names:
                names.append(n)
    print(f"{'conc':>4} {'steps':>5} {'batch':>6} {'prof. ms':>9} {'plain ms':>9} {'TPOT ms':>8} "
          + " ".join(f"{n:>17}" for n in names))  # fmt: skip
    for lv in s["levels"]:
        sp = lv["split"]
        if sp is None:
            print(f"{lv['concurrency']:>4} no profiled decode step")
            continue
        cells = []
        for n in names:
            c = sp["components"].get(n)
            cells.append("-" if c is None else f"{c['ms_mean']:.2f} ({100 * c['share']:.0f}%)")
        print(f"{lv['concurrency']:>4} {sp['num_steps']:>5} {sp['batch_mean']:>6.1f} "
              f"{sp['step_ms_mean']:>9.2f} {lv.get('unprofiled_ms_at_batch') or 0:>9.2f} "
              f"{lv['tpot_ms_mean']:>8.2f} "
              + " ".join(f"{c:>17}" for c in cells))  # fmt: skip
    sweep, fit = s["split"], s["step_fit"]
    if sweep:
        for n, c in sweep["components"].items():
            slope = "-" if c["b_ms_per_seq"] is None else f"{c['b_ms_per_seq']:.4f}"
            print(f"sweep {n}: {c['a_ms']:.3f} + {slope}·batch ms")
    if fit:
        print(f"steps not profiled: {fit['a_ms']:.3f} + {fit['b_ms_per_seq'] or 0:.4f}·batch ms "
              f"(R² {fit['r2'] or 0:.3f}, {fit['n']} steps)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-level", type=int, default=2, help="x the largest concurrency")
    p.add_argument("--every", type=int, default=8, help="profile every N-th engine step")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--memory-fraction", type=float, default=0.5)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir for the server")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--bench-timeout", type=float, default=900)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    a.gpus = None
    work = tempfile.mkdtemp(prefix="kvrelay-step-split-")
    proc, url = start("single", a, work)
    try:
        s = summarise(bench(url, a, work, "split", ["--step-profile-every", str(a.every)]))
    finally:
        stop(proc)
    s["meta"] = meta(a) | {"every": a.every, "concurrency": a.concurrency}
    print_table(s)
    print(f"logs and raw bench JSON: {work}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
