"""DeepSeek-V4 on the torch reference path through the engine: the baseline the kernels must beat.

dsv4-mini (Flash's per-layer shapes, 20 layers, NVFP4 experts, dummy weights): prefill tokens/s
of one long prompt, decode tokens/s at several batch sizes, GPU memory; per-layer times (CUDA
events) next to HF transformers' DeepSeek-V4 on the same weights for a few layers in bf16 (one
sliding, one CSA, one HCA layer: all that fits beside the staging copy of its dense experts).

    python benchmarks/dsv4_reference.py --out bench-results/dsv4_reference.json
CPU dry run:  python benchmarks/dsv4_reference.py --model dsv4-tiny --device cpu --prompt-len 64 \
                  --decode-context 32 --decode-batches 1,2 --decode-steps 2 --hf-layers 0,1,2
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import time

import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine
from kvrelay.engine.messages import AddRequest, SamplingParams


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class LayerTimer:
    """Per-layer times of one forward: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: str) -> None:
        self.device, self.marks = device, []

    def __call__(self, i: int) -> None:
        if self.device == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def layer_ms(self) -> list[float]:
        sync(self.device)
        m = self.marks
        if self.device == "cuda":
            return [m[i].elapsed_time(m[i + 1]) for i in range(len(m) - 1)]
        return [(m[i + 1] - m[i]) * 1e3 for i in range(len(m) - 1)]


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def timed_step(engine: Engine, device: str, timer: LayerTimer | None = None) -> float:
    engine.runner.family.layer_hook = timer
    sync(device)
    t0 = time.perf_counter()
    engine.step()
    sync(device)
    engine.runner.family.layer_hook = None
    return (time.perf_counter() - t0) * 1e3


def run_engine(a: argparse.Namespace) -> tuple[dict, Engine]:
    batches = [int(b) for b in a.decode_batches.split(",")]
    tokens = a.prompt_len + 16 + max(batches) * (a.decode_context + a.decode_steps + 8)
    cfg = EngineConfig(
        model=a.model,
        load_format="dummy",
        device=a.device,
        dtype=a.dtype,
        attention_backend="reference",  # this benchmark is the reference path's (layer hooks)
        cache=CacheConfig(max_total_tokens=tokens),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max(a.prompt_len, a.decode_context),
            max_running_requests=max(batches) + 1,
        ),
    )
    t0 = time.perf_counter()
    engine = Engine(cfg)
    sync(a.device)
    res: dict = {"build_s": time.perf_counter() - t0}
    if a.device == "cuda":
        res["weights_gib"] = torch.cuda.memory_allocated() / 2**30
    vocab = engine.src.config.vocab_size
    greedy = SamplingParams(max_tokens=a.decode_steps + 1, temperature=0.0, ignore_eos=True)

    # warm-up: a short prefill and a decode step
    engine.add(AddRequest("warm", random_ids(256, vocab, 0), greedy))
    while engine.has_work:
        engine.step()

    # one long prompt: its prefill (one chunk), then decode at batch 1 with that context
    engine.add(AddRequest("long", random_ids(a.prompt_len, vocab, 1), greedy))
    timer = LayerTimer(a.device)
    ms = timed_step(engine, a.device, timer)
    res["prefill"] = {
        "prompt_len": a.prompt_len,
        "ms": ms,
        "tok_s": a.prompt_len / ms * 1e3,
        "layer_ms": timer.layer_ms(),
    }
    steps, layer_sum = [], None
    while engine.has_work:
        timer = LayerTimer(a.device)
        steps.append(timed_step(engine, a.device, timer))
        lm = timer.layer_ms()
        if lm:
            layer_sum = (
                lm if layer_sum is None else [x + y for x, y in zip(layer_sum, lm, strict=True)]
            )
    n = len(steps) - 1  # the last step only emits the finish
    res["decode_long_context"] = {
        "context": a.prompt_len,
        "step_ms": sum(steps[:n]) / max(n, 1),
        "layer_ms": [x / max(len(steps), 1) for x in (layer_sum or [])],
    }

    res["decode"] = []
    for b in batches:
        for i in range(b):
            engine.add(
                AddRequest(f"b{b}-{i}", random_ids(a.decode_context, vocab, 100 + i), greedy)
            )
        engine.step()  # admits and prefills (chunks up to the budget)
        while any(r.num_computed < len(r.prompt_ids) for r in engine.scheduler.running):
            engine.step()
        steps = []
        for _ in range(a.decode_steps):
            steps.append(timed_step(engine, a.device))
        while engine.has_work:
            engine.step()
        step_ms = sorted(steps)[len(steps) // 2]
        res["decode"].append(
            {
                "batch": b,
                "context": a.decode_context,
                "step_ms": step_ms,
                "tok_s": b / step_ms * 1e3,
            }
        )
    if a.device == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        res["cache_gib"] = (
            sum(t.numel() * t.element_size() for t in engine.runner.cache.kinds.values()) / 2**30
        )
    engine.check_idle_integrity()
    return res, engine


def stage_hf_weights(engine: Engine, layers: list[int]) -> tuple[dict, dict]:
    """The HF config and HF-named weights (bf16, on the CPU) of `layers` of the engine's model."""
    from kvrelay.models.deepseek_v4.experts import Fp4Experts

    model = engine.runner.model
    c = engine.src.config
    sub = c.with_(
        num_hidden_layers=len(layers),
        layer_types=tuple(c.layer_types[i] for i in layers),
        mlp_layer_types=tuple(c.mlp_layer_types[i] for i in layers),
        expert_format="dense",
        qat_simulation=False,
    )
    own = model.state_dict()
    keep = ("model.embed_tokens.", "model.norm.", "model.hc_head.", "lm_head.")
    sd = {name: t.to("cpu") for name, t in own.items() if name.startswith(keep)}
    for j, i in enumerate(layers):
        pre, new = f"model.layers.{i}.", f"model.layers.{j}."
        for name, t in own.items():
            if name.startswith(pre) and ".mlp.experts." not in name:  # routed experts below
                sd[new + name[len(pre) :]] = t.to("cpu")
        experts = model.model.layers[i].mlp.experts
        if isinstance(experts, Fp4Experts):
            w = [experts.expert_weights(e) for e in range(c.n_routed_experts)]
            sd[new + "mlp.experts.gate_up_proj"] = torch.stack([g for g, _ in w]).to(
                "cpu", torch.bfloat16
            )
            sd[new + "mlp.experts.down_proj"] = torch.stack([d for _, d in w]).to(
                "cpu", torch.bfloat16
            )
            del w
        else:
            sd[new + "mlp.experts.gate_up_proj"] = experts.gate_up_proj.detach().to("cpu")
            sd[new + "mlp.experts.down_proj"] = experts.down_proj.detach().to("cpu")
    return sub.to_hf_dict(), sd


def run_hf(hf_cfg: dict, sd: dict, a: argparse.Namespace) -> dict:
    import transformers

    cfg = transformers.DeepseekV4Config(**hf_cfg)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(a.device):
            model = transformers.DeepseekV4ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    model.eval()
    timer = LayerTimer(a.device)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, i=i: timer(i))
    layers[-1].register_forward_hook(lambda *_: timer(len(layers)))
    ids = torch.tensor([random_ids(a.prompt_len, cfg.vocab_size, 1)], device=a.device)
    out: dict = {"missing_keys": len(missing), "unexpected_keys": len(unexpected)}
    with torch.no_grad():
        model(ids[:, :256])  # warm-up
        timer.marks = []
        sync(a.device)
        t0 = time.perf_counter()
        res = model(ids, use_cache=True)
        sync(a.device)
        out["prefill_ms"] = (time.perf_counter() - t0) * 1e3
        out["prefill_layer_ms"] = timer.layer_ms()
        try:
            timer.marks = []
            nxt = res.logits[:, -1:].argmax(-1)
            model(nxt, past_key_values=res.past_key_values, use_cache=True)
            out["decode_layer_ms"] = timer.layer_ms()
        except Exception as e:  # HF's cached path is not what we measure; report why it failed
            out["decode_error"] = f"{type(e).__name__}: {e}"[:200]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dsv4-mini")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--decode-context", type=int, default=1024)
    p.add_argument("--decode-batches", default="1,32")
    p.add_argument("--decode-steps", type=int, default=5)
    p.add_argument("--hf-layers", default="0,2,3", help="engine layers to rebuild in HF ('' skips)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.device == "cpu":
        a.dtype = "float32"
    res, engine = run_engine(a)
    kinds = list(engine.src.config.layer_types)
    res["layer_types"] = kinds
    if a.hf_layers:
        layers = [int(x) for x in a.hf_layers.split(",")]
        hf_cfg, sd = stage_hf_weights(engine, layers)
        del engine
        gc.collect()
        if a.device == "cuda":
            torch.cuda.empty_cache()
        hf = run_hf(hf_cfg, sd, a)
        hf["engine_layers"] = layers
        res["hf"] = hf
    else:
        del engine
    res["meta"] = {
        "model": a.model,
        "device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    print_table(res)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


def print_table(res: dict) -> None:
    pf = res["prefill"]
    print(
        f"build {res['build_s']:.1f}s  weights {res.get('weights_gib', 0):.1f} GiB  "
        f"peak {res.get('peak_gib', 0):.1f} GiB  cache {res.get('cache_gib', 0):.2f} GiB"
    )
    print(f"prefill {pf['prompt_len']} tok: {pf['ms']:.0f} ms = {pf['tok_s']:.0f} tok/s")
    dl = res["decode_long_context"]
    print(
        f"decode b=1 ctx {dl['context']}: {dl['step_ms']:.1f} ms/step = {1e3 / dl['step_ms']:.1f} tok/s"
    )
    for d in res["decode"]:
        print(
            f"decode b={d['batch']} ctx {d['context']}: {d['step_ms']:.1f} ms/step = {d['tok_s']:.1f} tok/s"
        )
    hf = res.get("hf")
    if hf:
        print(
            "layer  kind                          ours prefill  HF prefill   ours decode  HF decode (ms)"
        )
        for j, i in enumerate(hf["engine_layers"]):
            hd = hf.get("decode_layer_ms")
            print(
                f"{i:>5}  {res['layer_types'][i]:<28}  {pf['layer_ms'][i]:>12.1f}  {hf['prefill_layer_ms'][j]:>10.1f}"
                f"   {dl['layer_ms'][i]:>11.2f}  {hd[j] if hd else float('nan'):>9.2f}"
            )
        if "decode_error" in hf:
            print("HF decode failed:", hf["decode_error"])


if __name__ == "__main__":
    main()
