"""How many chained MTP drafts the tiny DeepSeek-V4 agent accepts (CPU, float32, real weights):
the agent with its trained MTP block (tests/data/dsv4-tiny-agent-mtp.safetensors) continues
prefixes of its own conversations greedily with `--speculative-algorithm mtp` at K = 1..4
drafts per step; per K: the mean accepted length (tokens per verify step), the tokens per
decode step of a request (every step after its prompt; since 2026-12-07 nothing is rolled
back, so it equals the first unless a step had no draft), the acceptance of each draft position, and
whether every output equals the plain engine's.

    python benchmarks/mtp_chain_acceptance.py [--k 1,2,3,4] [--prompts 8] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
from pathlib import Path

import torch
from agent_prompts import AGENT, agent_prompts

from kvrelay.config import CacheConfig, EngineConfig, SpeculativeConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

REPO = Path(__file__).resolve().parents[1]
BLOCK = REPO / "tests" / "data" / "dsv4-tiny-agent-mtp.safetensors"


def _count_decode_steps(engine: Engine) -> list[int]:
    """[n]: how many times a request past its prompt is scheduled, counted as steps run."""
    counted = [0]
    schedule = engine.scheduler.schedule

    def watched():
        batch, unfittable = schedule()
        counted[0] += sum(1 for s in batch if s.req.output_ids)
        return batch, unfittable

    engine.scheduler.schedule = watched
    return counted


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--k", default="1,2,3,4")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--cut", type=int, default=200, help="prompt tokens of each conversation")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    base = EngineConfig(
        model=str(AGENT), device="cpu", dtype="float32", cache=CacheConfig(max_total_tokens=16384)
    )
    prompts = agent_prompts(a.prompts, a.cut)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    plain = Engine(base)
    want = [[t for o in r for t in o.token_ids] for r in generate(plain, prompts, params)]
    rows = []
    for k in [int(x) for x in a.k.split(",")]:
        spec_cfg = SpeculativeConfig("mtp", k, draft_model_path=str(BLOCK))
        eng = Engine(dataclasses.replace(base, speculative=spec_cfg), plain.src)
        decode_steps = _count_decode_steps(eng)
        got = [[t for o in r for t in o.token_ids] for r in generate(eng, prompts, params)]
        s = eng.drafter.stats
        row = {
            "k": k,
            "mean_accepted_length": 1 + s.num_accepted_tokens / max(s.num_drafts, 1),
            # the first token of each output comes from its prompt's step
            "tokens_per_decode_step": sum(len(g) - 1 for g in got) / max(decode_steps[0], 1),
            "acceptance_per_position": [x / max(s.num_drafts, 1) for x in s.accepted_per_pos],
            "drafts": s.num_drafts,
            "outputs_equal_plain": sum(w == g for w, g in zip(want, got, strict=True)),
            "outputs": len(want),
        }
        rows.append(row)
        print(json.dumps(row))
    if a.out:
        result = {
            "date": datetime.date.today().isoformat(), "machine": platform.machine(),
            "torch": torch.__version__, "model": "dsv4-tiny-agent + trained MTP block",
            "prompts": a.prompts, "prompt_tokens": a.cut, "max_tokens": a.max_tokens, "rows": rows,
        }  # fmt: skip
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
