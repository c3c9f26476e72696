"""The batched DeepSeek-V4 forward (one pass per layer over every sequence, caches addressed by
pool row) against the per-sequence oracle path, and the decode-graph bookkeeping (buckets,
padding rows, context buckets) run eagerly on CPU: the same tokens and logprobs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from eager_graphs import use_eager_graphs

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.models.deepseek_v4.batch_meta import build_meta
from kvrelay.models.deepseek_v4.graphs import context_bucket
from kvrelay.weights.loader import resolve

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend

VOCAB = resolve("dsv4-tiny", "dummy").config.vocab_size


def make_engine(backend: str, budget: int = 96, qat: bool = False, **cache) -> Engine:
    src = resolve("dsv4-tiny", "dummy")
    src = dataclasses.replace(src, config=src.config.with_(qat_simulation=qat))
    cfg = EngineConfig(
        model="dsv4-tiny",
        load_format="dummy",
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        cache=CacheConfig(max_total_tokens=8192, **cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, kv_reserve_ratio=0.0),
    )
    return Engine(cfg, src)


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def run(engine: Engine, ps: list[list[int]], n: int = 24):
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = generate(engine, ps, p)
    toks = [[t for o in r for t in o.token_ids] for r in outs]
    lps = [[lp for o in r for lp in o.logprobs or []] for r in outs]
    return toks, lps


# Budget 96 tokens per step: long prompts prefill in chunks that end mid-window, several
# windows of both ratios close inside one chunk, and prefill chunks share steps with decodes.
@pytest.mark.parametrize("qat", [False, True])
def test_batched_equals_per_sequence_reference(qat: bool) -> None:
    ps = prompts([3, 17, 150] if qat else [3, 16, 17, 77, 201], seed=int(qat))
    want_t, want_lp = run(make_engine("reference", qat=qat), ps, n=16)
    eng = make_engine("torch", qat=qat)
    got_t, got_lp = run(eng, ps, n=16)
    assert got_t == want_t
    delta = max(
        abs(a - b)
        for x, y in zip(got_lp, want_lp, strict=False)
        for a, b in zip(x, y, strict=False)
    )
    assert delta < 1e-4
    eng.check_idle_integrity()


def test_fp8_index_keys_chunking_invariant() -> None:
    """With fp8 index keys the batched path reads every key back from the pool, also those its
    own step wrote, so any chunking gives the same result. (The per-sequence path scores a
    chunk's own keys before their fp8 rounding, so it is not the oracle here.)"""
    ps = prompts([40, 201], seed=5)
    want = run(make_engine("torch", budget=4096, index_k_dtype="fp8"), ps, n=16)
    got = run(make_engine("torch", budget=7, index_k_dtype="fp8"), ps, n=16)
    assert got[0] == want[0]


def test_graph_buffers_padding_and_buckets_equal_plain_steps() -> None:
    ps = prompts([5, 30, 61, 100, 9], seed=3)
    want_t, want_lp = run(make_engine("torch"), ps, n=40)
    eng = make_engine("torch")
    use_eager_graphs(eng, max_bs=8)
    got_t, got_lp = run(eng, ps, n=40)
    assert got_t == want_t
    delta = max(
        abs(a - b)
        for x, y in zip(got_lp, want_lp, strict=False)
        for a, b in zip(x, y, strict=False)
    )
    assert delta < 1e-4
    # 5 decoding requests -> bucket 8 (fewer while others still prefill); contexts up to 140
    # -> the smallest context bucket
    keys = set(eng.runner.graphs.graphs)
    assert (8, 512, 1) in keys and {ctx for _, ctx, _ in keys} == {context_bucket(1, 16)} == {512}
    eng.check_idle_integrity()


def test_meta_lists_closers_and_each_sequences_last_two() -> None:
    # seq 0: positions 2..13 (closes ratio-4 windows at 3, 7 and 11); seq 1: position 11
    m = build_meta([2, 11], [12, 1], [[1], [2]], [1, 2], (4,), 16, torch.device("cpu"))
    assert m.positions.tolist() == list(range(2, 14)) + [11]
    c = m.closers[4]
    assert c.rows.tolist() == [1, 5, 9, 12] and c.valid.all()
    assert c.keeps_prev.tolist() == [False, True, True, True]
    assert m.max_entries == {4: 3}
