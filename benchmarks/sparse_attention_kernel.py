"""Benchmark the Triton sparse MQA kernel (DeepSeek-V4 attention with sinks) on the GPU.

Decode: H=64, D=512, bf16; each query row attends to its sequence's Ka=128 window rows plus
Kb compressed entries: 512 (CSA top-k at 32k context), 32 and 256 (HCA at 4k / 32k context),
for batches T = 1..256, over pools sized for those contexts (random rows). Reports the median
CUDA-graph replay time (triton.testing.do_bench, L2 flushed; eager beside it), achieved GB/s
(gathered rows (Ka+Kb)*D*2 per query + q + out) against 4.2 TB/s, and the torch reference's
time at T=1 and 64. Prefill: T=4096 query rows of one sequence, TFLOP/s against ~720 (bf16
matmul measured on the H200), with every entry valid (random) and with the causal lists of a
real prompt (window t-127..t, top-512 of the compressed entries visible at t, -1 padded).
Sweeps (--sweep): split counts per batch, and tile configs (DV_SPLIT, BLOCK_N, num_stages),
each with its error against the reference. --config '{"DV_SPLIT": 2, "num_warps": 4}' runs
the main tables with a tile override.

    python benchmarks/sparse_attention_kernel.py [--out benchmarks/results/sparse_attention_kernel.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

H, D, KA = 64, 512, 128
DTYPE = torch.bfloat16
HBM_GBS = 4200.0
PEAK_TFLOPS = 720.0
# Kb -> (label, compressed entries per sequence in the pool)
KB_CASES = {512: ("CSA 32k", 8192), 32: ("HCA 4k", 32), 256: ("HCA 32k", 256)}
SWEEP_CONFIGS = [
    {"DV_SPLIT": 1, "num_warps": 8, "BLOCK_N": bn, "num_stages": st}
    for bn in (16, 32, 64)
    for st in (2, 3, 4)
] + [
    {"DV_SPLIT": 2, "num_warps": 4, "BLOCK_N": bn, "num_stages": st}
    for bn in (16, 32, 64)
    for st in (2, 3)
]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/sparse_attention_kernel.json")
    p.add_argument("--batches", default="1,8,32,64,128,256", help="decode batch sizes T")
    p.add_argument("--kb", default="512,32,256", help="compressed entries per query row")
    p.add_argument("--prefill-len", type=int, default=4096, help="prefill query rows")
    p.add_argument("--sweep", action="store_true", help="also sweep split counts and tiles")
    p.add_argument("--config", type=json.loads, default=None, help="tile override (JSON)")
    return p.parse_args(argv)


def _decode_inputs(t: int, kb: int, per_seq: int, gen: torch.Generator) -> tuple:
    """Each of t sequences owns 128 window rows and per_seq compressed rows of the pools; a
    query row lists its window (ring order) and kb random compressed rows of its sequence."""
    dev = "cuda"
    q = torch.randn(t, H, D, generator=gen, device=dev).to(DTYPE)
    kv_a = torch.randn(t * KA, D, generator=gen, device=dev).to(DTYPE)
    kv_b = torch.randn(t * per_seq, D, generator=gen, device=dev).to(DTYPE)
    seq = torch.arange(t, device=dev)[:, None]
    ring = torch.argsort(torch.rand(t, KA, generator=gen, device=dev), dim=1)
    idx_a = (seq * KA + ring).to(torch.int32)
    if kb == per_seq:  # HCA: every compressed entry of the sequence, in order
        idx_b = seq * per_seq + torch.arange(kb, device=dev)[None, :]
    else:
        idx_b = seq * per_seq + torch.randint(0, per_seq, (t, kb), generator=gen, device=dev)
    sinks = torch.randn(H, generator=gen, device=dev)
    return q, kv_a, idx_a, kv_b, idx_b.to(torch.int32), sinks


def _prefill_inputs(t: int, causal: bool, gen: torch.Generator) -> tuple:
    """One sequence of t tokens: window pool = its t raw rows, compressed pool = t/4 entries.
    causal: the real lists (window t-127..t, top-512 of the entries visible at t, -1 padded);
    otherwise every entry is valid and random (the kernel's full work)."""
    dev = "cuda"
    nc = t // 4
    kb = min(512, nc)
    q = torch.randn(t, H, D, generator=gen, device=dev).to(DTYPE)
    kv_a = torch.randn(t, D, generator=gen, device=dev).to(DTYPE)
    kv_b = torch.randn(nc, D, generator=gen, device=dev).to(DTYPE)
    sinks = torch.randn(H, generator=gen, device=dev)
    pos = torch.arange(t, device=dev)[:, None]
    if not causal:
        idx_a = torch.randint(0, t, (t, KA), generator=gen, device=dev)
        idx_b = torch.randint(0, nc, (t, kb), generator=gen, device=dev)
    else:
        idx_a = pos - KA + 1 + torch.arange(KA, device=dev)[None, :]
        idx_a = torch.where(idx_a >= 0, idx_a, -1)
        visible = (pos + 1) // 4  # entries j < (t + 1) // 4
        score = torch.rand(t, nc, generator=gen, device=dev)
        score = score.masked_fill(torch.arange(nc, device=dev)[None, :] >= visible, -1.0)
        top = score.topk(kb, dim=1)
        idx_b = torch.where(top.values >= 0, top.indices, -1)
    return q, kv_a, idx_a.to(torch.int32), kv_b, idx_b.to(torch.int32), sinks


def _reference(args: tuple, scale: float) -> torch.Tensor:
    from kvrelay.models.deepseek_v4.sparse_attention import sparse_attention

    q, kv_a, idx_a, kv_b, idx_b, sinks = args
    shifted = torch.where(idx_b >= 0, idx_b.long() + kv_a.shape[0], -1)
    kv, idx = torch.cat((kv_a, kv_b)), torch.cat((idx_a.long(), shifted), 1)
    return lambda: sparse_attention(q, kv, idx, sinks, scale)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _graph_ms(fn) -> float:
    """Median time of a CUDA-graph replay of fn (compiled first, outside the capture)."""
    from triton.testing import do_bench

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, return_mode="median")


def bench_decode(t: int, kb: int, with_reference: bool, config: dict | None) -> dict:
    from triton.testing import do_bench

    from kvrelay.kernels.triton_sparse_attention import sparse_mqa, sparse_mqa_splits

    label, per_seq = KB_CASES[kb]
    gen = torch.Generator(device="cuda").manual_seed(t * 1000 + kb)
    args = _decode_inputs(t, kb, per_seq, gen)
    scale = D**-0.5
    out = torch.full_like(args[0], float("nan"))
    fn = lambda: sparse_mqa(*args, scale, out=out, config=config)
    ms = _graph_ms(fn)
    eager_ms = do_bench(fn, return_mode="median")
    ref_fn = _reference(args, scale)
    err = _rel_err(out, ref_fn())  # out holds the last replay's result
    gathered = t * (KA + kb) * D * 2
    moved = gathered + 2 * t * H * D * 2
    chunk, splits = sparse_mqa_splits(t, KA + kb, H, args[0].device)
    row = {
        "case": label,
        "T": t,
        "Ka": KA,
        "Kb": kb,
        "splits": splits,
        "chunk": chunk,
        "us": ms * 1e3,
        "us_eager": eager_ms * 1e3,
        "bytes": moved,
        "gb_per_s": moved / ms / 1e6,
        "frac_hbm": moved / ms / 1e6 / HBM_GBS,
        "tflops": 4 * t * H * D * (KA + kb) / ms / 1e9,
        "rel_err_vs_fp32_ref": err,
    }
    if with_reference:
        row["torch_ref_us"] = do_bench(ref_fn, return_mode="median") * 1e3
    return row


def bench_prefill(t: int, causal: bool, config: dict | None) -> dict:
    from triton.testing import do_bench

    from kvrelay.kernels.triton_sparse_attention import sparse_mqa

    gen = torch.Generator(device="cuda").manual_seed(7 + causal)
    args = _prefill_inputs(t, causal, gen)
    scale = D**-0.5
    out = torch.empty_like(args[0])
    ms = do_bench(lambda: sparse_mqa(*args, scale, out=out, config=config), return_mode="median")
    ref = _reference(args, scale)()
    valid = int((args[2] >= 0).sum() + (args[4] >= 0).sum())
    listed = t * (KA + args[4].shape[1])
    return {
        "T": t,
        "causal": causal,
        "us": ms * 1e3,
        "valid_entries": valid,
        "tflops_valid": 4 * H * D * valid / ms / 1e9,
        "tflops_listed": 4 * H * D * listed / ms / 1e9,
        "frac_peak": 4 * H * D * valid / ms / 1e9 / PEAK_TFLOPS,
        "rel_err_vs_fp32_ref": _rel_err(out, ref),
    }


def sweep_splits(batches: list[int], config: dict | None) -> list[dict]:
    """Graph-replay time per forced split count, CSA decode (Ka=128, Kb=512)."""
    from kvrelay.kernels.triton_sparse_attention import sparse_mqa, sparse_mqa_splits

    rows = []
    for t in batches:
        gen = torch.Generator(device="cuda").manual_seed(t)
        args = _decode_inputs(t, 512, 8192, gen)
        out = torch.empty_like(args[0])
        default = sparse_mqa_splits(t, KA + 512, H, args[0].device)[1]
        times = {}
        for s in (1, 2, 3, 4, 5, 6, 8, 10, 14, 20):
            fn = lambda s=s, a=args, o=out: sparse_mqa(*a, D**-0.5, s, o, config)
            times[s] = _graph_ms(fn)
        best = min(times, key=times.get)
        rows.append(
            {
                "T": t,
                "default_splits": default,
                "best_splits": best,
                "us": {s: v * 1e3 for s, v in times.items()},
            }
        )
    return rows


def sweep_configs(cases: list[tuple[int, int]], prefill_len: int) -> list[dict]:
    """Time per tile config (BLOCK_N, num_stages) at default splits; decode (T, Kb) cases
    by graph replay, and the full prefill."""
    from triton.testing import do_bench

    from kvrelay.kernels.triton_sparse_attention import sparse_mqa

    rows = []
    work = [(f"decode T={t} Kb={kb}", _decode_inputs(t, kb, KB_CASES[kb][1],
             torch.Generator(device="cuda").manual_seed(t))) for t, kb in cases]  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(3)
    work.append((f"prefill T={prefill_len}", _prefill_inputs(prefill_len, False, gen)))
    for name, args in work:
        out = torch.empty_like(args[0])
        times = {}
        ref = _reference(args, D**-0.5)()
        errors = {}
        for cfg in SWEEP_CONFIGS:
            key = f"dv{cfg['DV_SPLIT']}-n{cfg['BLOCK_N']}-st{cfg['num_stages']}"
            fn = lambda cfg=cfg, a=args, o=out: sparse_mqa(*a, D**-0.5, out=o, config=cfg)
            try:
                if name.startswith("decode"):
                    times[key] = _graph_ms(fn) * 1e3
                else:
                    times[key] = do_bench(fn, return_mode="median") * 1e3
                errors[key] = _rel_err(out, ref)
            except Exception as e:  # e.g. out of shared memory: record and go on
                times[key] = f"{type(e).__name__}: {str(e)[:120]}"
        ok = {k: v for k, v in times.items() if isinstance(v, float)}
        best = min(ok, key=ok.get) if ok else None
        rows.append({"case": name, "best": best, "us": times, "rel_err": errors})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("sparse_attention_kernel: needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton

    batches = [int(b) for b in args.batches.split(",")]
    kbs = [int(k) for k in args.kb.split(",")]
    cfg = args.config
    decode = [bench_decode(t, kb, t in (1, 64), cfg) for kb in kbs for t in batches]
    prefill = [bench_prefill(args.prefill_len, c, cfg) for c in (False, True)]
    result = {
        "benchmark": "sparse_attention_kernel",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "shape": {"heads": H, "head_dim": D, "Ka": KA, "dtype": "bfloat16"},
        "config_override": cfg,
        "ceilings": {"hbm_gb_per_s": HBM_GBS, "bf16_tflops": PEAK_TFLOPS},
        "decode": decode,
        "prefill": prefill,
    }
    if args.sweep:
        result["sweep_splits"] = sweep_splits([t for t in batches if t <= 128], cfg)
        result["sweep_configs"] = sweep_configs([(64, 512), (256, 512), (8, 512)], args.prefill_len)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"sparse MQA decode  H={H} D={D} bf16 Ka={KA} config={cfg}; graph replay, L2 flushed")
    print(
        f"{'case':>8} {'T':>4} {'Kb':>4} {'splits':>6} {'us':>7} {'eager':>7} {'GB/s':>6} "
        f"{'%HBM':>5} {'TFLOP/s':>7} {'ref us':>7} {'err':>7}"
    )
    for r in decode:
        ref = f"{r['torch_ref_us']:7.0f}" if "torch_ref_us" in r else f"{'':>7}"
        print(
            f"{r['case']:>8} {r['T']:>4} {r['Kb']:>4} {r['splits']:>6} {r['us']:7.1f} "
            f"{r['us_eager']:7.1f} {r['gb_per_s']:6.0f} {100 * r['frac_hbm']:5.1f} "
            f"{r['tflops']:7.1f} {ref} {r['rel_err_vs_fp32_ref']:7.1e}"
        )
    for p in prefill:
        print(
            f"prefill T={p['T']} {'causal lists' if p['causal'] else 'all valid   '}: "
            f"{p['us']:.0f} us, {p['tflops_valid']:.0f} TFLOP/s on valid entries "
            f"({100 * p['frac_peak']:.0f}% of {PEAK_TFLOPS:.0f}), {p['tflops_listed']:.0f} on "
            f"listed, err {p['rel_err_vs_fp32_ref']:.1e}"
        )
    for s in result.get("sweep_splits", []):
        us = " ".join(f"{k}:{v:.1f}" for k, v in s["us"].items())
        print(f"splits T={s['T']}: default {s['default_splits']} best {s['best_splits']} | {us}")
    for c in result.get("sweep_configs", []):
        us = " ".join(
            f"{k}:{v:.1f}" if isinstance(v, float) else f"{k}:ERR" for k, v in c["us"].items()
        )
        worst = max(c["rel_err"].values(), default=float("nan"))
        print(f"tiles {c['case']}: best {c['best']} (worst err {worst:.1e}) | {us}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
