"""DeepSeek-V4 decode step time: the fast path (batched forward, Triton kernels, CUDA graphs)
against the per-sequence reference path, at several batch sizes and contexts, with the bytes a
step must move and its fraction of the measured copy bandwidth; plus prefill tokens/s at each
`--prefill` length (in chunks of `--prefill-chunk` tokens), its GEMM TFLOP/s from the model's
shapes (dsv4_flops.py) and their fraction of the measured bf16 matmul peak.

Decode steps run on requests whose caches are filled with random values rather than prefilled
(a 256 x 32k prefill would take the whole lease): step time depends on shapes, not on values.
Where the pool cannot hold batch x context distinct tokens, requests share pages (marked
`shared_pages`: their reads may hit L2, so those times flatter).

    python benchmarks/dsv4_decode.py --out bench-results/dsv4_decode.json
CPU dry run: python benchmarks/dsv4_decode.py --model dsv4-tiny --device cpu --batches 1,2 \
                 --contexts 64 --steps 2 --reference-batches 1 --prefill 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import time

import torch
from decode_throughput import copy_bandwidth  # same directory
from dsv4_flops import attention_flops_per_token, gemm_flops_per_token, matmul_peak_tflops

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine
from kvrelay.engine.messages import SamplingParams
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.models.deepseek_v4.config import CSA, HCA
from kvrelay.weights.loader import resolve

PREFILL_CHUNK = 8192  # tokens per prefill step (dsv4_profile and dsv4_launch_sources too)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_bytes(cfg, batch: int, ctx: int, weights: dict) -> float:
    """Bytes a decode step must move: attention/shared/other weights once, the routed experts
    a uniformly routed batch touches, and each sequence's cache reads."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    distinct = e * (1 - (1 - k / e) ** batch)
    total = weights["dense"] + len(cfg.layer_types) * distinct * weights["expert"]
    d, di = cfg.head_dim, cfg.index_head_dim
    per_seq = 0
    for t in cfg.layer_types:
        per_seq += cfg.sliding_window * d * 2
        if t == CSA:
            per_seq += min(cfg.index_topk, ctx // 4) * d * 2 + ctx // 4 * di * 2
        elif t == HCA:
            per_seq += ctx // cfg.hca_compress_ratio * d * 2
    return total + batch * per_seq


def weight_bytes(model) -> dict:
    expert, dense = 0, 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".mtp." in name:
            continue
        if ".experts." in name:
            expert += t.numel() * t.element_size()
        else:
            dense += t.numel() * t.element_size()
    n_layers = len(model.model.layers)
    return {"dense": dense, "expert": expert / n_layers / model.config.n_routed_experts}


def make_engine(a: argparse.Namespace, backend: str) -> Engine:
    src = resolve(a.model, "dummy")
    cfg = EngineConfig(
        model=a.model,
        load_format="dummy",
        device=a.device,
        dtype=a.dtype,
        attention_backend=backend,
        linear_weights=getattr(a, "linear_weights", "auto"),
        deterministic=getattr(a, "deterministic", False),
        max_model_len=max(a.contexts) + 64,
        cache=CacheConfig(memory_fraction=0.9),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=getattr(a, "prefill_chunk", PREFILL_CHUNK),
            max_running_requests=max(a.batches) + 1,
        ),
    )
    return Engine(cfg, src)


def fake_requests(engine: Engine, batch: int, ctx: int) -> tuple[list[Request], bool]:
    """`batch` requests with `ctx` cached tokens each: pages (shared when the pool is short),
    a state slot each, random token ids."""
    r, pages, slots = engine.runner, engine.scheduler.page_pool, engine.scheduler.slot_pool
    n_pages = -(-(ctx + 1) // r.page_size)
    shared = n_pages * batch > pages.num_free
    common = pages.alloc(n_pages) if shared else None
    reqs = []
    for b in range(batch):
        ids = torch.randint(0, r.model_cfg.vocab_size, (ctx + 1,)).tolist()
        req = Request(f"bench-{b}", ids, SamplingParams(max_tokens=1), 0)
        req.pages = pages.share(common) if shared else pages.alloc(n_pages)
        req.state_slot = slots.alloc(1)[0]
        req.num_computed = ctx
        reqs.append(req)
    if shared:
        pages.free(common)  # the requests hold their own references
    return reqs, shared


def release(engine: Engine, reqs: list[Request], shared: bool) -> None:
    pages, slots = engine.scheduler.page_pool, engine.scheduler.slot_pool
    for q in reqs:
        pages.free(q.pages)  # shared pages go back with the last reference
        slots.free([q.state_slot])


def randomize_pools(engine: Engine) -> None:
    for t in engine.runner.cache.kinds.values():
        if t.is_floating_point() and t.element_size() > 1:
            t.normal_()
        else:
            t.view(torch.uint8).random_(0, 120)  # fp8: finite codes


def time_decode(engine: Engine, batch: int, ctx: int, steps: int, device: str) -> dict:
    reqs, shared = fake_requests(engine, batch, ctx)
    sched = [ScheduledRequest(q, 1) for q in reqs]
    engine.runner.forward(sched)  # graph capture / warm-up
    times = []
    for _ in range(steps):
        sync(device)
        t = time.perf_counter()
        engine.runner.forward(sched)
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    release(engine, reqs, shared)
    return {"step_ms": statistics.median(times), "shared_pages": shared}


def time_prefill(engine: Engine, n: int, chunk: int, device: str) -> float:
    """Tokens/s of one n-token prompt prefilled chunk by chunk (the engine's own step size)."""
    r = engine.runner
    ids = torch.randint(0, r.model_cfg.vocab_size, (n,)).tolist()
    pages, slots = engine.scheduler.page_pool, engine.scheduler.slot_pool

    def run(tokens: int) -> float:
        req = Request("prefill", ids[:tokens], SamplingParams(max_tokens=1), 0)
        req.pages = pages.alloc(-(-tokens // r.page_size))
        req.state_slot = slots.alloc(1)[0]
        sync(device)
        t = time.perf_counter()
        while req.num_computed < tokens:
            step = min(chunk, tokens - req.num_computed)
            r.forward([ScheduledRequest(req, step)])
            req.num_computed += step
        sync(device)
        dt = time.perf_counter() - t
        pages.free(req.pages)
        slots.free([req.state_slot])
        return dt

    run(min(n, chunk))  # warm-up: kernels tuned, the allocator's pools grown
    return n / run(n)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dsv4-mini")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--contexts", default="4096,32768")
    p.add_argument("--reference-batches", default="1,8")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prefill", default="4096", help="prompt lengths, e.g. 4096,32768")
    p.add_argument(
        "--prefill-chunk", type=int, default=PREFILL_CHUNK, help="tokens per prefill step"
    )
    p.add_argument("--linear-weights", default="auto", choices=["auto", "fp8"])
    p.add_argument(
        "--deterministic", action="store_true",
        help="the batch-invariant mode (issue 22: its cost); no reference-path rows",
    )  # fmt: skip
    p.add_argument("--out", default=None)
    a = p.parse_args()
    a.batches = [int(x) for x in a.batches.split(",")]
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.prefill = [int(x) for x in a.prefill.split(",") if x]
    ref_batches = [int(x) for x in a.reference_batches.split(",") if x]
    if a.deterministic:  # the reference path is the torch one, which the mode refuses on a GPU
        ref_batches = []

    engine = make_engine(a, "auto")
    randomize_pools(engine)
    cfg = engine.runner.model_cfg
    bw = copy_bandwidth()  # random data, CUDA events: the dense benchmark's measurement
    wb = weight_bytes(engine.runner.model)
    rows = []
    for ctx in a.contexts:
        for b in a.batches:
            res = time_decode(engine, b, ctx, a.steps, a.device)
            need = step_bytes(cfg, b, ctx, wb)
            res.update(path="fast", batch=b, context=ctx, bytes=need)
            res["floor_ms"] = need / bw * 1e3
            res["x_floor"] = res["step_ms"] / res["floor_ms"]
            rows.append(res)
            print(json.dumps(res), flush=True)
    gemm = gemm_flops_per_token(engine.runner.model)
    peak = matmul_peak_tflops(a.device) if a.device == "cuda" else float("nan")
    prefill_rows = []
    for n in a.prefill:
        tok_s = time_prefill(engine, n, a.prefill_chunk, a.device)
        tflops = tok_s * gemm / 1e12
        prefill_rows.append(
            {
                "tokens": n,
                "fast_tok_s": tok_s,
                "gemm_flops_per_token": gemm,
                "attention_flops_per_token": attention_flops_per_token(cfg, n),
                "gemm_tflops": tflops,
                "frac_of_matmul_peak": tflops / peak,
            }
        )
        print(json.dumps(prefill_rows[-1]), flush=True)
    # the first row under the old key, for readers of earlier results
    prefill = {**prefill_rows[0], "matmul_peak_tflops": peak, "lengths": prefill_rows}
    # the reference path on the same weights and pools
    engine.runner.family.reference, engine.runner.graphs = True, None
    for b in ref_batches:
        res = time_decode(engine, b, a.contexts[0], max(2, a.steps // 5), a.device)
        res.update(path="reference", batch=b, context=a.contexts[0])
        rows.append(res)
        print(json.dumps(res), flush=True)
    out = {
        "model": a.model,
        "dtype": a.dtype,
        "linear_weights": a.linear_weights,
        "deterministic": a.deterministic,
        "copy_bandwidth_Bps": bw,
        "weights": wb,
        "decode": rows,
        "prefill": prefill,
        "env": env_info(),
    }
    print_table(out)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


def env_info() -> dict:
    info = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        info["driver"] = subprocess.run(q, capture_output=True, text=True).stdout.strip()
    q = ["git", "rev-parse", "HEAD"]
    info["commit"] = subprocess.run(q, capture_output=True, text=True).stdout.strip()
    return info


def print_table(out: dict) -> None:
    print(f"\n{'path':9} {'batch':>5} {'ctx':>6} {'step ms':>9} {'floor ms':>9} {'x floor':>8}")
    for r in out["decode"]:
        fl = r.get("floor_ms", float("nan"))
        xf = r.get("x_floor", float("nan"))
        flag = " shared" if r["shared_pages"] else ""
        print(
            f"{r['path']:9} {r['batch']:>5} {r['context']:>6} {r['step_ms']:>9.2f} "
            f"{fl:>9.2f} {xf:>8.2f}{flag}"
        )
    for r in out["prefill"]["lengths"]:
        print(
            f"prefill {r['tokens']} tokens: {r['fast_tok_s']:.0f} tok/s, GEMMs "
            f"{r['gemm_tflops']:.0f} TFLOP/s = {r['frac_of_matmul_peak']:.2f} of the bf16 matmul "
            f"peak ({out['prefill']['matmul_peak_tflops']:.0f} TFLOP/s)"
        )


if __name__ == "__main__":
    main()
