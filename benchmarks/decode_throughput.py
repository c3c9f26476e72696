"""Decode throughput of a ~1B dense Llama (dummy bf16 weights) on one GPU.

For each batch size: the engine's decode step (schedule + forward + sample) and the pure forward
pass, with CUDA graphs on and off; tokens/s, step time, and achieved bandwidth = (weight bytes +
KV bytes read) / step time, as a fraction of the measured device-to-device copy bandwidth.
Also HF transformers `generate` on the same weights (batch 1 and 64) as the peer in the same run,
and a greedy-agreement check of the Triton path against the torch reference path on the GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import AddRequest, SamplingParams
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.models.llama.step import prepare

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for a dry run of the script


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    x = torch.randn((1 << 30) if DEV == "cuda" else (1 << 22), dtype=torch.bfloat16, device=DEV)
    y = torch.empty_like(x)
    ms = cuda_time(lambda: y.copy_(x), 20)
    return 2 * x.numel() * 2 / (ms / 1e3)


def cuda_time(fn, iters: int) -> float:
    """Median milliseconds per call, timed with CUDA events after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if DEV != "cuda":
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def fill_decode(engine: Engine, batch: int, context: int, steps: int, gen: torch.Generator) -> None:
    """Add `batch` requests with `context`-token prompts and run until all are decoding."""
    vocab = engine.src.config.vocab_size
    for i in range(batch):
        ids = torch.randint(0, vocab, (context,), generator=gen).tolist()
        engine.add(
            AddRequest(
                f"b{batch}-{i}",
                ids,
                SamplingParams(max_tokens=4 * steps + 32, temperature=0, ignore_eos=True),
            )
        )
    while (
        any(r.num_computed < len(r.prompt_ids) for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        for out in engine.step().outputs:
            if out.error:
                raise RuntimeError(out.error)


def measure(
    engine: Engine, batch: int, context: int, steps: int, weight_bytes: int, copy_bw: float
) -> list[dict]:
    runner = engine.runner
    rows = []
    graphs = runner.graphs
    for use_graphs in (True, False):
        runner.graphs = graphs if use_graphs else None
        sched = [
            ScheduledRequest(r, 1)
            for r in sorted(engine.scheduler.running, key=lambda r: r.arrival)
        ]
        # The forward alone: the same decode batch re-run (it rewrites the same KV slots).
        for s in sched:
            s.req.num_computed -= 1
        fb = prepare(sched, runner.page_size, runner.device)
        for s in sched:
            s.req.num_computed += 1
        fwd_ms = cuda_time(lambda fb=fb: runner.forward_inputs(fb), steps)
        # The whole engine step: schedule, prepare, forward, sample, bookkeeping.
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        step_ms = (time.perf_counter() - t0) * 1e3 / steps
        ctx = sum(r.num_tokens for r in engine.scheduler.running) / batch
        kv_bytes = batch * ctx * (runner.pool.spec.bytes_per_page // runner.page_size)
        total = weight_bytes + kv_bytes
        rows.append(
            dict(
                batch=batch,
                cuda_graphs=use_graphs,
                context=round(ctx),
                forward_ms=fwd_ms,
                step_ms=step_ms,
                tokens_per_s=batch / (step_ms / 1e3),
                bytes_per_step=total,
                forward_GBps=total / (fwd_ms / 1e3) / 1e9,
                step_GBps=total / (step_ms / 1e3) / 1e9,
                forward_frac_of_copy=total / (fwd_ms / 1e3) / copy_bw,
                step_frac_of_copy=total / (step_ms / 1e3) / copy_bw,
            )
        )
    runner.graphs = graphs
    for r in list(engine.scheduler.running):
        engine.abort(r.rid)
    engine.step()
    return rows


def hf_peer(engine: Engine, batch: int, context: int, new_tokens: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = engine.src.config
    hf_cfg = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        rope_scaling=c.rope_scaling,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    with torch.device(DEV):
        hf = LlamaForCausalLM(hf_cfg).to(engine.runner.dtype).eval()
    sd = engine.runner.model.hf_state_dict()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ids = torch.randint(0, c.vocab_size, (batch, context), device=DEV)

    def run(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t0

    run(2)
    per_token = (run(new_tokens) - run(1)) / (new_tokens - 1)
    return dict(
        batch=batch, context=context, step_ms=per_token * 1e3, tokens_per_s=batch / per_token
    )


def greedy_agreement(model: str, num_prompts: int, new_tokens: int) -> list[dict]:
    """Triton + CUDA graphs vs the torch reference path, both on the GPU, same dummy weights.
    At a divergence, the reference's top-2 logprob gap there tells a near-tie from a bug."""
    results: dict[str, list] = {}
    gen = torch.Generator().manual_seed(1)
    lens = [int(x) for x in torch.randint(5, 300, (num_prompts,), generator=gen)]
    for name, backend in (("fast", "triton" if DEV == "cuda" else "torch"), ("reference", "torch")):
        eng = Engine(
            EngineConfig(
                model=model,
                load_format="dummy",
                attention_backend=backend,
                cuda_graphs=name == "fast",
                cache=CacheConfig(max_total_tokens=8192),
            )
        )
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lens]
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=2)
        results[name] = generate(eng, prompts, params)
        del eng
        torch.cuda.empty_cache() if DEV == "cuda" else None
    rows = []
    for i, (fast, ref) in enumerate(zip(results["fast"], results["reference"], strict=True)):
        a = [t for o in fast for t in o.token_ids]
        b = [t for o in ref for t in o.token_ids]
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        gap = None
        if first is not None:
            top = ref[first].top_logprobs[0]
            gap = top[0].logprob - top[1].logprob
        rows.append(
            dict(
                prompt=i,
                prompt_len=lens[i],
                agree=first is None,
                first_divergence=first,
                ref_top2_gap=gap,
            )
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b", help="dummy preset")
    p.add_argument("--batch-sizes", default="1,8,64,256")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default="benchmarks/results/decode_throughput.json")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument(
        "--deterministic", action="store_true", help="batch-invariant mode (no greedy check)"
    )
    a = p.parse_args()
    batches = [int(x) for x in a.batch_sizes.split(",")]
    copy_bw = copy_bandwidth()
    engine = Engine(
        EngineConfig(
            model=a.model,
            load_format="dummy",
            deterministic=a.deterministic,
            max_cuda_graph_batch=max(batches),
            cache=CacheConfig(
                max_total_tokens=max(batches) * (a.context + 4 * a.steps + 64) + 4096
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=8192, max_running_requests=max(batches)
            ),
        )
    )
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    report = dict(
        gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
        torch=torch.__version__,
        python=platform.python_version(),
        date=time.strftime("%Y-%m-%d"),
        model=f"{a.model} (dummy weights)",
        deterministic=a.deterministic,
        params=sum(p.numel() for p in engine.runner.model.parameters()),
        weight_bytes=weight_bytes,
        copy_GBps=copy_bw / 1e9,
        rows=[],
        hf_peer=[],
        greedy_agreement=[],
    )
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        fill_decode(engine, b, a.context, a.steps, gen)
        report["rows"] += measure(engine, b, a.context, a.steps, weight_bytes, copy_bw)
        _dump(report, a.out)
    if not a.skip_hf:
        for b in (1, 64):
            report["hf_peer"].append(hf_peer(engine, b, a.context, 32))
            _dump(report, a.out)
    del engine
    torch.cuda.empty_cache() if DEV == "cuda" else None
    if not a.deterministic:
        report["greedy_agreement"] = greedy_agreement(a.model, 8, 32)
        _dump(report, a.out)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB")
    print("batch graphs ctx  fwd_ms  step_ms   tok/s   fwd_GB/s  fwd/copy  step/copy")
    for r in report["rows"]:
        print(
            f"{r['batch']:5d} {str(r['cuda_graphs']):6s} {r['context']:4d} {r['forward_ms']:7.3f} {r['step_ms']:8.3f} "
            f"{r['tokens_per_s']:8.0f} {r['forward_GBps']:9.0f} {r['forward_frac_of_copy']:8.2f} {r['step_frac_of_copy']:9.2f}"
        )
    for r in report["hf_peer"]:
        print(
            f"HF generate batch {r['batch']}: {r['step_ms']:.2f} ms/step, {r['tokens_per_s']:.0f} tok/s"
        )
    if a.deterministic:
        return
    agree = sum(r["agree"] for r in report["greedy_agreement"])
    print(
        f"greedy triton vs torch-reference on GPU: {agree}/8 prompts agree on 32 tokens;",
        [
            (r["prompt"], r["first_divergence"], round(r["ref_top2_gap"], 4))
            for r in report["greedy_agreement"]
            if not r["agree"]
        ],
    )


def _dump(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
