"""Benchmark the Triton lightning-indexer top-k (kvrelay.kernels.triton_indexer) on the GPU.

Decode shape of DeepSeek-V4: h=64 index heads, d=128, topk 512; T query tokens, each of its
own sequence with N visible entries (N = 1024 and 8192: 4k and 32k tokens of context at ratio
4) in shuffled pool rows; bf16 keys and fp8 keys (+ an fp32 scale per row). Reports the median
time of a CUDA-graph replay (triton.testing.do_bench, L2 flushed before each run; eager beside
it) of: the score kernel alone, the Triton radix select alone, the whole indexer_topk with the
Triton select and with the torch.topk select; achieved GB/s = (keys + scales + q bytes) / time
against 4.2 TB/s; and the torch reference (eager) at T = 1 and 64. Before timing, each shape's
result is checked against the reference (exact-integer inputs, so the sets must be equal).

    python benchmarks/indexer_kernel.py [--out benchmarks/results/indexer_kernel.json]
    python benchmarks/indexer_kernel.py --sweep   # also time score- and select-kernel configs
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

H, D, TOPK = 64, 128, 512
PEAK_GBPS = 4200.0
FP8 = torch.float8_e4m3fn
SWEEP = [
    {"BLOCK_N": bn, "KEYS_AS_A": a, "num_warps": nw, "num_stages": ns}
    for bn in (32, 64, 128)
    for a in (True, False)
    for nw in (4, 8)
    for ns in (2, 3)
] + [  # programs per row: tiles of BLOCK_N per program (default: about 8 programs per SM)
    {"BLOCK_N": 64, "KEYS_AS_A": True, "num_warps": 4, "num_stages": 3, "TILES": t}
    for t in (1, 2, 4, 8, 16, 32)
]

SELECT_SWEEP = [
    {"BLOCK": b, "RADIX_BITS": r, "num_warps": nw}
    for b in (1024, 2048, 4096, 8192)
    for r in (4, 8)
    for nw in (4, 8, 16, 32)
    if b // (32 * nw) in (4, 8, 16, 32)  # elements per thread
]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/indexer_kernel.json", help="JSON path")
    p.add_argument("--tokens", default="1,8,64,256", help="query tokens T")
    p.add_argument("--entries", default="1024,8192", help="visible entries N per sequence")
    p.add_argument("--keys", default="bf16,fp8", help="index-key formats")
    p.add_argument("--reference-tokens", default="1,64", help="T at which to time the reference")
    p.add_argument("--sweep", action="store_true", help="time kernel configs too")
    return p.parse_args(argv)


def _inputs(t_count: int, n: int, fp8: bool, exact: bool = False) -> dict:
    """T sequences of n entries each (all visible) in a shuffled pool; gaussian data, or small
    integers (exact=True: scores exact in any order, for the correctness check)."""
    m = t_count * n
    if exact:
        q = torch.randint(-4, 5, (t_count, H, D), device="cuda").float()
        k = torch.randint(-4, 5, (m, D), device="cuda").float()
        w = torch.randint(-8, 9, (t_count, H), device="cuda").float() / 64
        scale = torch.ones(m, device="cuda")
    else:
        q = torch.randn(t_count, H, D, device="cuda")
        k = torch.randn(m, D, device="cuda")
        w = torch.randn(t_count, H, device="cuda") * (D**-0.5 * H**-0.5)
        scale = k.abs().amax(dim=1) / 448.0
        k = k / scale[:, None] if fp8 else k
    return {
        "q": q.to(torch.bfloat16),
        "w": w,
        "keys": k.to(FP8 if fp8 else torch.bfloat16),
        "key_scale": scale if fp8 else None,
        "key_rows": torch.randperm(m, device="cuda").view(t_count, n).to(torch.int32),
        "seq_of_token": torch.arange(t_count, device="cuda", dtype=torch.int32),
        "n_visible": torch.full((t_count,), n, device="cuda", dtype=torch.int32),
    }


ARGS = ("q", "w", "keys", "key_scale", "key_rows", "seq_of_token", "n_visible")


def _time(fn) -> tuple[float, float]:
    """(graph-replay median us, eager median us)."""
    from triton.testing import do_bench

    eager = do_bench(fn, return_mode="median")
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    replay = do_bench(graph.replay, return_mode="median")
    return replay * 1e3, eager * 1e3


def _check(t_count: int, n: int, fp8: bool) -> None:
    from kvrelay.kernels.indexer_reference import indexer_topk_reference
    from kvrelay.kernels.triton_indexer import indexer_topk

    x = _inputs(min(t_count, 8), n, fp8, exact=True)
    args = [x[a] for a in ARGS]
    ref = indexer_topk_reference(*args, TOPK).sort(dim=1).values
    for select in ("triton", "torch"):
        got = indexer_topk(*args, TOPK, select=select).sort(dim=1).values
        if not torch.equal(got, ref):
            raise AssertionError(f"T={t_count} N={n} fp8={fp8} select={select}: sets differ")


def bench_case(t_count: int, n: int, fp8: bool, ref_tokens: set[int]) -> dict:
    from kvrelay.kernels import triton_indexer as ti
    from kvrelay.kernels.indexer_reference import indexer_topk_reference

    _check(t_count, n, fp8)
    x = _inputs(t_count, n, fp8)
    args = [x[a] for a in ARGS]
    scores = torch.empty(t_count, n, dtype=torch.float32, device="cuda")
    out = torch.empty(t_count, TOPK, dtype=torch.int64, device="cuda")
    key_bytes = t_count * n * (D * x["keys"].element_size() + (4 if fp8 else 0))
    q_bytes = x["q"].numel() * x["q"].element_size()
    nbytes = key_bytes + q_bytes
    res = {"tokens": t_count, "entries": n, "keys": "fp8" if fp8 else "bf16", "bytes": nbytes}
    res["scores_us"], res["scores_us_eager"] = _time(lambda: ti._launch_scores(*args, scores, None))
    ti._launch_scores(*args, scores, None)
    res["select_us"], _ = _time(lambda: ti._launch_select(scores, x["n_visible"], TOPK, out))
    res["select_torch_us"], _ = _time(
        lambda: ti.topk_select_torch(scores, x["n_visible"], TOPK, out)
    )
    res["total_us"], res["total_us_eager"] = _time(lambda: ti.indexer_topk(*args, TOPK, out=out))
    res["total_torch_select_us"], _ = _time(
        lambda: ti.indexer_topk(*args, TOPK, select="torch", out=out)
    )
    res["scores_gbps"] = nbytes / res["scores_us"] / 1e3
    res["total_gbps"] = nbytes / res["total_us"] / 1e3
    res["scores_frac_peak"] = res["scores_gbps"] / PEAK_GBPS
    if t_count in ref_tokens:
        from triton.testing import do_bench

        ms = do_bench(lambda: indexer_topk_reference(*args, TOPK), return_mode="median")
        res["reference_us"] = ms * 1e3
    return res


def _sweep(fn, configs: list[dict]) -> tuple[dict | None, list[dict]]:
    from triton.testing import do_bench

    rows = []
    for cfg in configs:
        try:
            ms = do_bench(lambda cfg=cfg: fn(cfg), return_mode="median")
        except Exception as e:  # a config that does not compile (shared memory, registers)
            rows.append({**cfg, "error": type(e).__name__})
            continue
        rows.append({**cfg, "us": ms * 1e3})
    ok = [r for r in rows if "us" in r]
    return (min(ok, key=lambda r: r["us"]) if ok else None), rows


def sweep_case(t_count: int, n: int, fp8: bool) -> dict:
    """Eager medians of every score-kernel config, and of every select-kernel config on the
    same row length (the select checked against the default config's output first)."""
    from kvrelay.kernels import triton_indexer as ti

    x = _inputs(t_count, n, fp8)
    args = [x[a] for a in ARGS]
    scores = torch.empty(t_count, n, dtype=torch.float32, device="cuda")
    best, rows = _sweep(lambda cfg: ti._launch_scores(*args, scores, cfg), SWEEP)
    ti._launch_scores(*args, scores, None)
    want = ti.topk_select(scores, x["n_visible"], TOPK).sort(dim=1).values
    out = torch.empty_like(want)
    for cfg in SELECT_SWEEP:
        ti._launch_select(scores, x["n_visible"], TOPK, out, cfg)
        if not torch.equal(out.sort(dim=1).values, want):
            raise AssertionError(f"select config {cfg} chose another set")
    sel_best, sel_rows = _sweep(
        lambda cfg: ti._launch_select(scores, x["n_visible"], TOPK, out, cfg), SELECT_SWEEP
    )
    return {"tokens": t_count, "entries": n, "keys": "fp8" if fp8 else "bf16", "best": best,
            "configs": rows, "select_best": sel_best, "select_configs": sel_rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("indexer_kernel: needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton

    torch.manual_seed(0)
    ref_tokens = set(map(int, args.reference_tokens.split(",")))
    cases = [
        bench_case(t, n, k == "fp8", ref_tokens)
        for k in args.keys.split(",")
        for n in map(int, args.entries.split(","))
        for t in map(int, args.tokens.split(","))
    ]
    sweeps = []
    if args.sweep:
        sweeps = [
            sweep_case(t, n, k == "fp8")
            for k in args.keys.split(",")
            for n, t in ((8192, 1), (8192, 64), (1024, 256))
        ]
    print(f"indexer top-k  h={H} d={D} topk={TOPK}  (us: CUDA-graph replay medians)")
    print(f"{'keys':>4} {'N':>5} {'T':>4} {'scores':>7} {'select':>7} {'sel.torch':>9} "
          f"{'total':>7} {'tot.torch':>9} {'GB/s':>6} {'%peak':>5} {'ref':>8}")  # fmt: skip
    for r in cases:
        ref = f"{r['reference_us']:>8.0f}" if "reference_us" in r else f"{'':>8}"
        print(f"{r['keys']:>4} {r['entries']:>5} {r['tokens']:>4} {r['scores_us']:>7.1f} "
              f"{r['select_us']:>7.1f} {r['select_torch_us']:>9.1f} {r['total_us']:>7.1f} "
              f"{r['total_torch_select_us']:>9.1f} {r['scores_gbps']:>6.0f} "
              f"{100 * r['scores_frac_peak']:>5.0f} {ref}")  # fmt: skip
    for s in sweeps:
        print(f"sweep {s['keys']} N={s['entries']} T={s['tokens']}: scores best {s['best']}")
        print(f"{'':>6}select best {s['select_best']}")
    result = {
        "benchmark": "indexer_kernel",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "shape": {"heads": H, "head_dim": D, "topk": TOPK, "q_dtype": "bfloat16"},
        "peak_gbps": PEAK_GBPS,
        "bytes_note": "keys (+ fp32 scales for fp8) + q; key_rows and the score scratch excluded",
        "cases": cases,
        "sweeps": sweeps,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
