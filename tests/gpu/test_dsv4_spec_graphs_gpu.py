"""DeepSeek-V4 speculative decoding on the GPU fast path (dsv4-tiny, float32): verify steps (up
to 1 + K rows per request, mixed counts through filler rows) and the MTP pass replayed from CUDA
graphs give the tokens and logprobs of the same engine run eagerly, and the plain greedy tokens.
(tests/spec/test_spec_dsv4.py runs the same graph buffers eagerly on the CPU.)"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from kvrelay.engine.drafter import draft_room
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.weights.loader import resolve

pytestmark = pytest.mark.gpu

K = 3
SPECS = {
    "ngram": SpeculativeConfig(algorithm="ngram", num_draft_tokens=K),
    "mtp": SpeculativeConfig(algorithm="mtp", num_draft_tokens=1),
    "mtp3": SpeculativeConfig(algorithm="mtp", num_draft_tokens=3),  # the block chained
}


def _engine(algorithm: str, graphs: bool) -> Engine:
    src = resolve("dsv4-tiny", "dummy")
    src = dataclasses.replace(src, config=src.config.with_(qat_simulation=False))
    cfg = EngineConfig(
        model="dsv4-tiny", load_format="dummy", device="cuda", dtype="float32",
        attention_backend="triton", cuda_graphs=graphs,
        cache=CacheConfig(max_total_tokens=16384),
        scheduler=SchedulerConfig(max_num_batched_tokens=128),
    )  # fmt: skip
    if algorithm != "none":
        cfg = dataclasses.replace(cfg, speculative=SPECS[algorithm])
    return Engine(cfg, src)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in (5, 17, 40, 99)]


def _planted(want: dict[tuple[int, ...], list[int]], vocab: int):
    """Drafts of the plain output with one wrong token at a cycling offset (all, some, none
    accepted; drafts of different lengths in one step)."""
    offsets = itertools.cycle(range(K + 1))

    def propose(req, budget: int) -> list[int]:
        out, pos = want[tuple(req.prompt_ids)], len(req.output_ids)
        draft = list(out[pos : pos + draft_room(req, K, budget, 1 << 30)])
        e = next(offsets)
        if e < len(draft):
            draft[e] = (draft[e] + 1) % vocab
        return draft

    return propose


def _run(engine: Engine, prompts, want=None):
    if want is not None:
        vocab = engine.runner.model_cfg.vocab_size
        engine.scheduler.drafter = _planted(
            {tuple(p): w for p, w in zip(prompts, want, strict=True)}, vocab
        )
    p = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = generate(engine, prompts, p)
    return (
        [[t for o in r for t in o.token_ids] for r in outs],
        [[lp for o in r for lp in o.logprobs or []] for r in outs],
    )


@pytest.mark.parametrize("algorithm", ["ngram", "mtp", "mtp3"])
def test_speculative_graphs_equal_eager_and_plain(algorithm: str) -> None:
    plain = _engine("none", graphs=True)
    prompts = _prompts(plain.runner.model_cfg.vocab_size)
    want = _run(plain, prompts)
    del plain
    planted = want[0] if algorithm == "ngram" else None
    eager = _run(_engine(algorithm, graphs=False), prompts, planted)
    graphed_engine = _engine(algorithm, graphs=True)
    graphed = _run(graphed_engine, prompts, planted)
    qs = {q for _, _, q in graphed_engine.runner.graphs.graphs}
    assert max(qs) == 1 + SPECS[algorithm].num_draft_tokens, qs
    assert graphed[0] == eager[0] == want[0]
    delta = max(
        abs(x - y)
        for r1, r2 in zip(graphed[1], eager[1], strict=True)
        for x, y in zip(r1, r2, strict=True)
    )
    assert delta < 1e-5
    graphed_engine.check_idle_integrity()
