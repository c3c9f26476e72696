"""`deterministic=True` where requests share KV: prefix-cache hits (a later turn resumes from
cached pages, so its prefill starts at a page boundary instead of 0 and runs beside other
requests' steps) and the n samples of one prompt (the followers wait for the leader's prefill,
then hit its pages and decode together). Each request must give the very bits it gives alone on
an engine without the prefix cache: tokens, logprobs and top logprobs, greedy and seeded
sampling (sample i of a group draws with seed + i, as the server assigns). On the CPU:
SmolLM2 (the embedded GGUF) and dsv4-tiny (random weights). Without the mode both fail here."""

from __future__ import annotations

import pytest
import torch
from test_deterministic import make_engine, results

from kvrelay.engine.engine import Engine
from kvrelay.engine.messages import AddRequest, SamplingParams

NEW = 3
N = 3  # samples of the shared prompt


def run(eng: Engine, reqs: list[AddRequest]) -> dict[str, tuple]:
    """All of `reqs` in one continuous batch: {rid: (tokens, logprobs, top logprobs)}."""
    for r in reqs:
        eng.add(r)
    per: dict[str, list] = {r.rid: [] for r in reqs}
    while eng.has_work:
        for out in eng.step().outputs:
            per[out.rid].append(out)
    return {rid: results(outs) for rid, outs in per.items()}


def workload(vocab: int) -> tuple[list[AddRequest], list[AddRequest]]:
    """Turn 1: a group of N samples of a 40-token prompt (sampled, seeds 500..) beside two
    requests of their own. Turn 2: prompts that extend turn 1's (two full 16-token pages to hit),
    greedy and sampled, beside a cold one."""
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(100, vocab - 100, (n,), generator=g).tolist()  # noqa: E731
    shared, other = ids(40), ids(37)

    def p(seed: int, temperature: float = 1.0) -> SamplingParams:
        return SamplingParams(
            max_tokens=NEW, temperature=temperature, seed=seed, ignore_eos=True, logprobs=2
        )

    turn1 = [AddRequest("g", shared, p(500), group="g")]
    turn1 += [AddRequest(f"g-{i}", shared, p(500 + i), group="g") for i in range(1, N)]
    turn1 += [AddRequest("o1", other, p(7)), AddRequest("o2", ids(21), p(0, 0.0))]
    turn2 = [
        AddRequest("t2-greedy", shared + ids(9), p(0, 0.0)),
        AddRequest("t2-sampled", shared[:33] + ids(12), p(11)),
        AddRequest("t2-other", other + ids(5), p(12)),
        AddRequest("t2-cold", ids(26), p(13)),
    ]
    return turn1, turn2


# dsv4-tiny in float32: there its default path differs alone and in a batch (in bf16 rarely).
@pytest.mark.parametrize("model,dtype", [("smollm2", "bfloat16"), ("dsv4-tiny", "float32")])
def test_hits_and_n_samples_equal_each_alone_without_the_cache(model: str, dtype: str) -> None:
    eng = make_engine(model, dtype=dtype)
    turn1, turn2 = workload(eng.runner.model_cfg.vocab_size)
    shared = {**run(eng, turn1), **run(eng, turn2)}
    prefix = eng.scheduler.prefix
    # The sharing really happened: the followers and three turn-2 prompts hit cached pages.
    assert prefix.hit_tokens >= (N - 1) * 32 + 3 * 32, prefix.hit_tokens
    eng.check_idle_integrity()

    ref = make_engine(model, prefix_cache=False, dtype=dtype)
    for r in turn1 + turn2:  # each alone, no cache, no group
        alone = run(ref, [AddRequest(r.rid, r.prompt_ids, r.params)])[r.rid]
        assert alone == shared[r.rid], f"{r.rid} differs from its run alone"
    assert ref.scheduler.prefix is None
