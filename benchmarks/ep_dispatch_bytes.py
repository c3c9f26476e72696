"""Bytes each rank sends per MoE: `--ep-dispatch all-reduce` vs `all-to-all`, from the routing
the all-to-all path would dispatch (`ep_dispatch.pair_plan`, the function the forward uses).

- all-reduce: a ring all-reduce of the [n, hidden] float32 partial sums: 2 (N-1)/N n h 4 bytes.
- all-to-all: the counts, each owned token's hidden state (model dtype) + its k expert ids (int64)
  and weights (float32) to every other rank holding one of its experts, the float32 weighted sums
  back, and the all-gather of the outputs (N-1 parts of ceil(n/N) rows, model dtype).
Reported: the busiest rank's bytes, and all-to-all / all-reduce.

Routing: the trained dsv4-tiny-agent's (8 experts, top-2, hidden 160) on its chat prompts,
every MoE of every step of a greedy run (prefill and decode steps apart); and the dsv4-flash
shape (256 experts, top-6, hidden 4096) with uniformly random routing at decode and prefill
batch sizes.

    python benchmarks/ep_dispatch_bytes.py [--out benchmarks/results/ep_dispatch_bytes.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvrelay.models.deepseek_v4.ep_dispatch import pair_plan

AGENT = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "dsv4-tiny-agent"
WORLDS = (2, 4, 8)


def bytes_per_rank(idx: torch.Tensor, n_experts: int, hidden: int, elt: int, world: int):
    """(all-reduce, all-to-all) bytes the busiest rank sends for one MoE over routing `idx`."""
    n, k = idx.shape
    ring = 2 * (world - 1) * n * hidden * 4 // world
    per_rank, worst = n_experts // world, 0
    bounds = [r * n // world for r in range(world + 1)]
    sent_back = [0] * world  # rows each rank computes for others (their weighted sums go back)
    out = [0] * world
    for r in range(world):
        _, rank, counts = pair_plan(idx[bounds[r] : bounds[r + 1]], per_rank, world)
        remote = int(counts.sum() - counts[r])
        out[r] = world * 8 + remote * (hidden * elt + k * 12)
        for d in range(world):
            if d != r:
                sent_back[d] += int(counts[d])
    gather = (world - 1) * -(-n // world) * hidden * elt
    worst = max(out[r] + sent_back[r] * hidden * 4 + gather for r in range(world))
    return ring, worst


def agent_routing() -> dict[str, list[torch.Tensor]]:
    """Every MoE's expert ids of every step of a greedy run of the agent, prefill/decode apart."""
    from transformers import AutoTokenizer

    from kvrelay.config import CacheConfig, EngineConfig
    from kvrelay.engine.engine import Engine, generate
    from kvrelay.engine.messages import SamplingParams
    from kvrelay.models.deepseek_v4.moe import Router
    from kvrelay.server.tools.dsv4_chat import encode_messages

    engine = Engine(
        EngineConfig(model=str(AGENT), device="cpu", dtype="float32",
                     cache=CacheConfig(max_total_tokens=4096))
    )  # fmt: skip
    seen: list[torch.Tensor] = []
    for m in engine.runner.model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(lambda _m, _a, out: seen.append(out[1].clone()))
    tok = AutoTokenizer.from_pretrained(str(AGENT))
    qs = ["What is the weather in Lima?", "Add 7 and 90.", "Count from 4 to 9.", "Hi"] * 4
    prompts = [
        tok(
            encode_messages([{"role": "user", "content": q}], None), add_special_tokens=False
        ).input_ids
        for q in qs
    ]
    generate(engine, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    batch = len(prompts)
    return {
        "prefill": [i for i in seen if i.shape[0] > batch],
        "decode": [i for i in seen if i.shape[0] <= batch],
    }


def random_routing(n: int, n_experts: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, n_experts, generator=g).topk(k, dim=1).indices


def summarise(idxs, n_experts, hidden, elt) -> dict:
    rows = {}
    for w in WORLDS:
        ar = a2a = 0
        for idx in idxs:
            x, y = bytes_per_rank(idx, n_experts, hidden, elt, w)
            ar, a2a = ar + x, a2a + y
        tokens = sum(i.shape[0] for i in idxs)
        rows[f"N={w}"] = {
            "all_reduce_bytes_per_token": round(ar / tokens, 1),
            "all_to_all_bytes_per_token": round(a2a / tokens, 1),
            "ratio": round(a2a / ar, 3),
        }
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/ep_dispatch_bytes.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    result = {}
    if (AGENT / "config.json").is_file():
        for phase, idxs in agent_routing().items():
            for dtype, elt in (("float32", 4), ("bfloat16", 2)):
                result[f"dsv4-tiny-agent {phase} {dtype}"] = summarise(idxs, 8, 160, elt)
    for n in (64, 4096):
        result[f"dsv4-flash random n={n} bfloat16"] = summarise(
            [random_routing(n, 256, 6)], 256, 4096, 2
        )
    for name, rows in result.items():
        print(name)
        for w, r in rows.items():
            print(f"  {w}: {r}")
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
