"""The Triton fused MoE (kvrelay/kernels/triton_moe.py) on DeepSeek-V4-mini/Flash routed experts
(E=256, H=4096, I=2048, k=6, NVFP4, bf16 x), random top-k routing, T tokens per call.

Timing: CUDA-graph replays (triton.testing.do_bench, median) of a graph that runs the MoE over
--sets different routings/inputs in turn (so that an expert's weights are not served from L2
by the previous call), divided by --sets. Floor: bytes that must move = the packed weights and
e4m3 scales of the distinct experts routed to (counted per set) + activations (x, act and y
written and read once, out written) over 4.2 TB/s; FLOP = 6 * T*k * H * I. The reference
(Fp4Experts.forward: per-expert Triton dequant to bf16 + F.linear, host syncs) is timed eagerly
at small T. --sweep also times a list of tile configs per T and reports the best.

    python benchmarks/moe_kernel.py --out benchmarks/results/moe_kernel.json [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton

from kvrelay.kernels.triton_moe import MoeConfig, default_config, fused_experts, group_assignments
from kvrelay.models.deepseek_v4 import preset
from kvrelay.models.deepseek_v4.experts import Fp4Experts

HBM = 4.2e12  # bytes/s, the H200's practical streaming ceiling (shared/reference)

SWEEP_SMALL = [  # rows per expert <= ~12
    MoeConfig(16, 64, 128, 4, 3),
    MoeConfig(16, 32, 128, 4, 3),
    MoeConfig(16, 64, 128, 8, 3),
    MoeConfig(16, 64, 128, 4, 3, swap_ab=True),
    MoeConfig(16, 64, 128, 4, 3, split_k=2),
    MoeConfig(16, 64, 128, 4, 3, split_k=4),
    MoeConfig(16, 64, 128, 4, 3, split_k=8),
    MoeConfig(16, 32, 128, 4, 3, split_k=2),
    MoeConfig(16, 32, 128, 4, 3, split_k=4),
    MoeConfig(16, 64, 64, 4, 4, split_k=4),
    MoeConfig(16, 128, 128, 4, 3, split_k=4),
    MoeConfig(16, 128, 128, 8, 3, split_k=8),
    MoeConfig(16, 64, 256, 4, 2, split_k=4),
]
SWEEP_LARGE = [  # prefill
    MoeConfig(128, 64, 64, 8, 3),
    MoeConfig(128, 64, 128, 8, 3),
    MoeConfig(128, 64, 64, 8, 4),
    MoeConfig(128, 128, 64, 8, 3),
    MoeConfig(128, 64, 64, 8, 3, swap_ab=True),
    MoeConfig(64, 64, 64, 4, 3),
    MoeConfig(64, 128, 64, 8, 3),
    MoeConfig(256, 64, 64, 8, 3),
    MoeConfig(128, 64, 64, 8, 3, fp16_mma=True),
    MoeConfig(128, 128, 64, 8, 3, fp16_mma=True),
]


def make_experts(e: int, h: int, i: int) -> Fp4Experts:
    cfg = preset("dsv4-mini").with_(n_routed_experts=e, hidden_size=h, moe_intermediate_size=i)
    ex = Fp4Experts(cfg, torch.bfloat16).cuda()
    with torch.no_grad():
        for p, s, s2 in (
            (ex.gate_up_packed, ex.gate_up_scale, ex.gate_up_scale_2),
            (ex.down_packed, ex.down_scale, ex.down_scale_2),
        ):
            p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, device="cuda"))
            s.copy_((torch.rand(s.shape, device="cuda") * 1.5 + 0.5).to(s.dtype))
            s2.copy_(torch.rand(s2.shape, device="cuda") * 0.5 / (2.93 * (2 * p.shape[-1]) ** 0.5))
    return ex


def inputs(t: int, e: int, h: int, k: int, sets: int):
    out = []
    for _ in range(sets):
        x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
        scores = torch.rand(t, e, device="cuda")
        w, idx = scores.topk(k, dim=-1)
        out.append((x, (w / w.sum(-1, keepdim=True)).float() * 1.5, idx))
    return out


def graph_time_us(fn, sets) -> float:
    """Median µs per call of fn(*s) over the rotating sets, replayed from one CUDA graph."""
    for s in sets:  # compile + warm up outside the capture
        fn(*s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for s in sets:
            fn(*s)
    ms = triton.testing.do_bench(g.replay, warmup=50, rep=300, return_mode="median")
    del g
    return ms * 1e3 / len(sets)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,8,32,64,128,256,4096")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--sets", type=int, default=8, help="routings rotated per timed call")
    p.add_argument("--sweep", action="store_true", help="also time a list of tile configs")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    e, h, i, k = a.experts, a.hidden, a.intermediate, a.top_k
    torch.manual_seed(0)
    ex = make_experts(e, h, i)
    per_expert = 3 * i * h // 2 + 3 * i * h // 16  # packed e2m1 + e4m3 scales
    rows = []
    for t in (int(s) for s in a.tokens.split(",")):
        sets = inputs(t, e, h, k, a.sets if t <= 256 else 2)
        distinct = sum(int(torch.unique(s[2]).numel()) for s in sets) / len(sets)
        n = t * k
        act_bytes = t * h * 2 + n * i * 2 * 2 + n * h * 2 * 2 + t * h * 4
        moved = distinct * per_expert + act_bytes
        flop = 6 * n * h * i
        x, w, idx = sets[0]
        err = (fused_experts(x, w, idx, ex).double() - ex.forward(x, w, idx).double()).norm()
        err = (err / ex.forward(x, w, idx).double().norm()).item()
        cfgs = [default_config(n, e)]
        if a.sweep:
            pool = SWEEP_SMALL if n / e <= 12 else SWEEP_LARGE
            cfgs += [c for c in pool if c != cfgs[0]]
        timings = []
        for cfg in cfgs:
            t0 = time.time()
            try:
                us = graph_time_us(
                    lambda x, w, idx, cfg=cfg: fused_experts(x, w, idx, ex, cfg), sets
                )
            except Exception as exc:  # a config that does not compile (shared memory, ...)
                timings.append({"config": cfg.__dict__, "error": repr(exc)[:300]})
                print(f"T={t} {cfg}: failed: {repr(exc)[:200]}")
                continue
            timings.append({"config": cfg.__dict__, "us": us, "wall_s": time.time() - t0})
        ok = [r for r in timings if "us" in r]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        bm = default_config(n, e).block_m
        group_us = graph_time_us(lambda x, w, idx, bm=bm: group_assignments(idx, e, bm), sets)
        ref_us = None
        if t <= 8:  # rotating the sets, as the graph does
            cycle = itertools.cycle(sets)
            ms = triton.testing.do_bench(
                lambda cycle=cycle: ex.forward(*next(cycle)),
                warmup=20, rep=200, return_mode="median",
            )  # fmt: skip
            ref_us = ms * 1e3
        us = timings[0].get("us", float("nan"))
        row = {
            "T": t,
            "assignments": n,
            "distinct_experts": distinct,
            "MB_moved": moved / 1e6,
            "floor_us": moved / HBM * 1e6,
            "default_config": cfgs[0].__dict__,
            "us": us,
            "GB_s": moved / us / 1e3,
            "frac_of_4.2TB_s": moved / us / 1e-6 / HBM,
            "TFLOP_s": flop / us / 1e6,
            "best_us": best["us"] if best else None,
            "best_config": best["config"] if best else None,
            "group_us": group_us,
            "reference_us": ref_us,
            "rel_err_vs_reference": err,
            "sweep": timings,
        }
        rows.append(row)
        print(
            f"T={t:<5} us={us:9.1f} floor={row['floor_us']:8.1f} GB/s={row['GB_s']:7.0f} "
            f"({row['frac_of_4.2TB_s']:.0%}) TFLOP/s={row['TFLOP_s']:6.1f} "
            f"best={row['best_us'] or float('nan'):9.1f} group={group_us:6.1f} err={err:.1e}",
            flush=True,
        )
    print()
    print(
        f"{'T':>5} {'experts':>7} {'MB':>7} {'floor us':>9} {'us':>9} {'GB/s':>6} {'%4.2TB':>6} "
        f"{'TFLOP/s':>7} {'best us':>8} {'group us':>8} {'ref us':>8} {'rel err':>8}"
    )
    for r in rows:
        ref = f"{r['reference_us']:8.1f}" if r["reference_us"] else f"{'-':>8}"
        best = r["best_us"] if r["best_us"] is not None else float("nan")
        print(
            f"{r['T']:>5} {r['distinct_experts']:>7.1f} {r['MB_moved']:>7.0f} "
            f"{r['floor_us']:>9.1f} {r['us']:>9.1f} {r['GB_s']:>6.0f} "
            f"{r['frac_of_4.2TB_s']:>6.0%} {r['TFLOP_s']:>7.1f} {best:>8.1f} "
            f"{r['group_us']:>8.1f} {ref} {r['rel_err_vs_reference']:>8.1e}"
        )
    if a.sweep:
        for r in rows:
            if r["best_config"]:
                print(f"T={r['T']}: best {r['best_config']} ({r['best_us']:.1f} us)")
    if a.out:
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "shape": {"E": e, "H": h, "I": i, "k": k, "format": "nvfp4", "x": "bfloat16"},
        }
        with open(a.out, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
