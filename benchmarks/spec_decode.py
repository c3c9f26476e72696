"""Speculative decoding in the offline engine: time per output token with and without
`--speculative-algorithm ngram|mtp` at a few concurrencies, the mean accepted length, and how
many requests give the plain greedy tokens exactly. (mtp: DeepSeek-V4 only, one draft per step;
with dummy weights its drafts are random: the number is the overhead bound.)

Prompts repeat spans (a tool result quoted back, as agentic traffic does). With dummy weights
the acceptance says nothing about real traffic (the model copies nothing; a looping output
accepts nearly every draft): there the number that matters is the cost of a verify step (on
CUDA, DeepSeek-V4's verify steps and MTP pass replay graphs; dense models' run eagerly); give
real weights (`--model PATH --load-format auto`) for acceptance. `--oracle-drafts` adds a run
whose drafts are the plain run's own continuation (every draft accepted: what a perfect drafter
reaches; with mtp the MTP block still runs every step), so a step's cost with and without
acceptance are both measured. Checked on CPU (qwen3-tiny, dsv4-tiny).

    python benchmarks/spec_decode.py [--model smollm2-135m --load-format dummy] [--out PATH]
    python benchmarks/spec_decode.py --model dsv4-mini --algorithm mtp --concurrency 1,8
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import platform
import random
import time
from pathlib import Path

import torch

from kvrelay.config import CacheConfig, EngineConfig, SpeculativeConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--algorithm", default="ngram", choices=["ngram", "mtp"])
    p.add_argument(
        "--draft-tokens", default=None, help="K, or a list: 1,3 (default: 4 ngram, 1 mtp)"
    )
    p.add_argument("--draft-model-path", default="", help="mtp: the MTP block's safetensors")
    p.add_argument(
        "--agent-prompts",
        action="store_true",
        help="prompts from the tiny agent's own conversations (--model: the agent's directory)",
    )
    p.add_argument(
        "--oracle-drafts",
        action="store_true",
        help="also run with the plain output as the drafts (all accepted)",
    )
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    return p.parse_args(argv)


def _prompts(n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        tool = [rng.randrange(100, vocab) for _ in range(96)]
        out.append([rng.randrange(100, vocab) for _ in range(32)] + tool + tool[:48])
    return out


def _run(engine: Engine, prompts, params) -> tuple[list[list[int]], float, dict]:
    """Tokens, seconds and the drafts counted. Warm first on the same prompts: every batch and
    context bucket the timed run reaches has its kernels compiled and its graphs captured (a
    warm-up on one prompt left the captures of bigger batches in the timed run: on the H100
    the plain agent's c1..c64 came out at 40-50 ms per token against ~1 ms)."""
    generate(engine, prompts, params)
    stats = engine.drafter.stats.as_dict() if engine.drafter else {}
    t0 = time.perf_counter()
    outs = generate(engine, prompts, params)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    after = engine.drafter.stats.as_dict() if engine.drafter else {}
    counted = {k: after[k] - stats[k] for k in after}
    return [[t for o in r for t in o.token_ids] for r in outs], seconds, counted


def _oracle(want: dict[tuple[int, ...], list[int]], k: int):
    """A drafter proposing the plain run's next tokens of the request's prompt."""

    def propose(req, budget: int) -> list[int]:
        out, pos = want[tuple(req.prompt_ids)], len(req.output_ids)
        if not req.output_ids:
            return []
        return list(out[pos : pos + min(k, budget - 1, req.remaining_max_tokens - 1)])

    return propose


def _release() -> None:
    """After `del engine`: its weights and caches go before the next one is built (dsv4-mini's
    ~80 GB do not fit twice on one GPU)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    a = _parse(argv)
    base = EngineConfig(
        model=a.model, load_format=a.load_format, dtype=a.dtype, max_cuda_graph_batch=64,
        cache=CacheConfig(max_total_tokens=64 * 1024),
    )  # fmt: skip
    ks = [int(x) for x in (a.draft_tokens or ("1" if a.algorithm == "mtp" else "4")).split(",")]
    levels = [int(x) for x in a.concurrency.split(",")]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    plain = Engine(base)
    src, dtype = plain.src, str(plain.runner.dtype)
    if a.agent_prompts:
        from agent_prompts import agent_prompts

        prompts = {c: agent_prompts(c, 200, Path(a.model)) for c in levels}
    else:
        prompts = {c: _prompts(c, src.config.vocab_size) for c in levels}
    baseline = {c: _run(plain, prompts[c], params)[:2] for c in levels}  # (tokens, seconds)
    del plain
    _release()
    rows = []
    for k in ks:
        spec_cfg = SpeculativeConfig(a.algorithm, k, draft_model_path=a.draft_model_path)
        spec = Engine(dataclasses.replace(base, speculative=spec_cfg), src)
        for c in levels:
            want, t_plain = baseline[c]
            got, t_spec, counted = _run(spec, prompts[c], params)
            drafts, accepted = counted["num_drafts"], counted["num_accepted_tokens"]
            row = {
                "draft_tokens": k,
                "concurrency": c,
                # ms per output token of one request (all run together to max_tokens)
                "plain_tpot_ms": t_plain / a.max_tokens * 1e3,
                "spec_tpot_ms": t_spec / a.max_tokens * 1e3,
                "speedup": t_plain / t_spec,
                "mean_accepted_length": 1 + accepted / drafts if drafts else None,
                "exact_requests": sum(w == g for w, g in zip(want, got, strict=True)),
                "requests": c,
            }
            if a.oracle_drafts:
                drafter = spec.scheduler.drafter
                spec.scheduler.drafter = _oracle(
                    {tuple(p): w for p, w in zip(prompts[c], want, strict=True)}, k
                )
                got, t_oracle, counted = _run(spec, prompts[c], params)
                spec.scheduler.drafter = drafter
                drafts, accepted = counted["num_drafts"], counted["num_accepted_tokens"]
                row.update(
                    oracle_tpot_ms=t_oracle / a.max_tokens * 1e3,
                    oracle_speedup=t_plain / t_oracle,
                    oracle_accepted_length=1 + accepted / drafts if drafts else None,
                    oracle_exact_requests=sum(w == g for w, g in zip(want, got, strict=True)),
                )
            rows.append(row)
            print(json.dumps(row))
        del spec
        _release()
    result = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.machine(),
        "torch": torch.__version__,
        "model": a.model,
        "load_format": a.load_format,
        "dtype": dtype,
        "max_tokens": a.max_tokens,
        "algorithm": a.algorithm,
        "rows": rows,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
