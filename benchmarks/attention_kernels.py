"""Benchmark the Triton paged-attention kernels on the GPU.

Decode: batch 1/8/64/256 x context 1k/4k/16k, Hq=32, Hkv=8, D=64, bf16, page 16; reports the
median time of a CUDA-graph replay (triton.testing.do_bench, L2 flushed; eager time beside it)
and achieved GB/s = KV bytes read / time.
Prefill: one fresh 4096-token sequence; reports TFLOP/s (causal FLOPs), beside torch SDPA on
contiguous K/V as an anchor.

    python benchmarks/attention_kernels.py [--out benchmarks/results/attention_kernels.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

HQ, HKV, D, PAGE = 32, 8, 64, 16
DTYPE = torch.bfloat16


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/attention_kernels.json", help="JSON path")
    p.add_argument("--batches", default="1,8,64,256", help="decode batch sizes")
    p.add_argument("--contexts", default="1024,4096,16384", help="decode context lengths")
    p.add_argument("--prefill-len", type=int, default=4096, help="prefill sequence length")
    p.add_argument("--num-splits", type=int, default=None, help="decode splits (default: auto)")
    return p.parse_args(argv)


def _paged_cache(batch: int, ctx: int, d: int) -> tuple[torch.Tensor, ...]:
    """Random full-length sequences in a cache whose pages are shuffled (as after churn)."""
    pages_per_seq = -(-ctx // PAGE)
    num_pages = batch * pages_per_seq
    k_cache = torch.randn(num_pages, PAGE, HKV, d, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.randperm(num_pages, device="cuda").view(batch, pages_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, page_table.to(torch.int32), seq_lens


def bench_decode(batch: int, ctx: int, num_splits: int | None) -> dict:
    from triton.testing import do_bench

    from kvrelay.kernels.triton_attention import default_num_splits, paged_decode_attention

    k_cache, v_cache, page_table, seq_lens = _paged_cache(batch, ctx, D)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
    splits = num_splits or default_num_splits(batch, HKV, page_table.shape[1] * PAGE, q.device)
    fn = lambda: paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens, D**-0.5, splits)
    eager_ms = do_bench(fn, return_mode="median")
    # Decode runs inside CUDA graphs: time a replay (no Python launch cost); do_bench flushes
    # L2 before each call, so the KV is read from HBM.
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = do_bench(graph.replay, return_mode="median")
    kv_bytes = 2 * batch * ctx * HKV * D * k_cache.element_size()
    return {
        "batch": batch,
        "context": ctx,
        "num_splits": splits,
        "us": ms * 1e3,
        "us_eager": eager_ms * 1e3,
        "kv_bytes": kv_bytes,
        "gb_per_s": kv_bytes / ms / 1e6,
    }


def bench_prefill(seq_len: int) -> dict:
    import torch.nn.functional as F
    from triton.testing import do_bench

    from kvrelay.kernels.triton_attention import paged_attention

    k_cache, v_cache, page_table, seq_lens = _paged_cache(1, seq_len, D)
    q = torch.randn(seq_len, HQ, D, device="cuda", dtype=DTYPE)
    cu = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")
    scale = D**-0.5
    ms = do_bench(
        lambda: paged_attention(q, k_cache, v_cache, page_table, seq_lens, cu, scale, seq_len),
        return_mode="median",
    )
    # Anchor: SDPA (flash) on contiguous K/V of the same shapes.
    qs = q.transpose(0, 1)[None]
    ks = torch.randn(1, HKV, seq_len, D, device="cuda", dtype=DTYPE)
    vs = torch.randn_like(ks)
    sdpa_ms = do_bench(
        lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
        return_mode="median",
    )
    flops = 4 * HQ * D * seq_len * (seq_len + 1) / 2  # QK^T and PV over the causal pairs
    return {
        "seq_len": seq_len,
        "us": ms * 1e3,
        "tflops": flops / ms / 1e9,
        "sdpa_us": sdpa_ms * 1e3,
        "sdpa_tflops": flops / sdpa_ms / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("attention_kernels: needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton

    torch.manual_seed(0)
    decode = [
        bench_decode(b, c, args.num_splits)
        for b in map(int, args.batches.split(","))
        for c in map(int, args.contexts.split(","))
    ]
    prefill = bench_prefill(args.prefill_len)
    print(f"decode  Hq={HQ} Hkv={HKV} D={D} bf16 page={PAGE}")
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'us graph':>9} {'us eager':>9} {'GB/s':>6}")
    for r in decode:
        print(
            f"{r['batch']:>6} {r['context']:>8} {r['num_splits']:>6} "
            f"{r['us']:>9.1f} {r['us_eager']:>9.1f} {r['gb_per_s']:>6.0f}"
        )
    print(
        f"prefill 1 x {prefill['seq_len']}: {prefill['us']:.0f} us, "
        f"{prefill['tflops']:.0f} TFLOP/s (SDPA contiguous: {prefill['sdpa_tflops']:.0f})"
    )
    result = {
        "benchmark": "attention_kernels",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "shape": {"hq": HQ, "hkv": HKV, "head_dim": D, "page_size": PAGE, "dtype": "bfloat16"},
        "decode": decode,
        "prefill": prefill,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
