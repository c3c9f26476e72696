"""Dense graphs (models/llama/graphs.py): a speculating SmolLM2 engine whose verify steps
run the graph runner's padded layout (q = 1 + K rows per request, padding rows to the dummy page,
padding requests up to the bucket) gives the plain engine's tokens, and logprobs within 1e-4,
as the eager verify path does (tests/spec/test_spec_engine.py); without speculation, the decode
graphs alone give the same. On the CPU 'replay' is an eager
forward on the runner's static buffers (tests/eager_graphs.py); the GPU captures the same."""

from __future__ import annotations

import collections
import dataclasses

import pytest
from eager_graphs import use_eager_dense_graphs

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

CFG = EngineConfig(
    cache=CacheConfig(max_total_tokens=4096, page_size=16),
    scheduler=SchedulerConfig(max_num_batched_tokens=128),
)
LIST = "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango"
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def engines():
    plain = Engine(CFG)
    spec = Engine(dataclasses.replace(CFG, speculative=SpeculativeConfig("ngram", 4)), plain.src)
    graphs = use_eager_dense_graphs(spec)
    replays = collections.Counter()
    replay = graphs._replay

    def counted(bs: int, q: int):
        replays[(bs, q)] += 1
        return replay(bs, q)

    graphs._replay = counted
    return plain, spec, replays


def _flat(outs):
    toks = [[t for o in r for t in o.token_ids] for r in outs]
    lps = [[x for o in r for x in o.logprobs or []] for r in outs]
    return toks, lps


@pytest.mark.parametrize("n", [1, 3])
def test_verify_graphs_give_the_plain_tokens(engines, smollm2_tokenizer, n):
    plain, spec, replays = engines
    texts = [
        f"Copy the list exactly.\nList: {LIST}.\nCopy: apple,",
        f"Repeat after me: {LIST}. Again: {LIST}. Again:",
        "Count: one, two, three, four, five, six,",
    ][:n]
    prompts = [smollm2_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    replays.clear()
    want_toks, want_lps = _flat(generate(plain, prompts, PARAMS))
    got_toks, got_lps = _flat(generate(spec, prompts, PARAMS))
    assert got_toks == want_toks
    for g, w in zip(got_lps, want_lps, strict=True):
        assert g == pytest.approx(w, abs=1e-4)
    verify = sum(c for (bs, q), c in replays.items() if q == 5)
    assert verify > 0, f"no verify step ran on the graphs: {dict(replays)}"
    if n == 3:  # three requests in the bucket of 4: one padding request in every replay
        assert any(bs == 4 and q == 5 for bs, q in replays), dict(replays)
    assert spec.drafter.stats.as_dict()["num_accepted_tokens"] > 0
    spec.check_idle_integrity()


def test_decode_graphs_alone_give_the_plain_tokens(engines, smollm2_tokenizer):
    """Without speculation the runner holds decode graphs only (q = 1): the same check."""
    plain = engines[0]
    graphed = Engine(CFG, plain.src)
    graphs = use_eager_dense_graphs(graphed)
    assert set(graphs.graphs) == {(bs, 1) for bs in graphs.buckets}
    replays, replay = collections.Counter(), graphs._replay
    graphs._replay = lambda bs, q: replays.update([(bs, q)]) or replay(bs, q)
    prompts = [
        smollm2_tokenizer.encode(t, add_special_tokens=False)
        for t in ("Name three rivers:", f"List: {LIST}. Again:", "2 + 2 =")
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    want_toks, want_lps = _flat(generate(plain, prompts, params))
    got_toks, got_lps = _flat(generate(graphed, prompts, params))
    assert replays[(4, 1)] >= 10, dict(replays)  # three requests decode in the bucket of 4
    assert got_toks == want_toks
    for g, w in zip(got_lps, want_lps, strict=True):
        assert g == pytest.approx(w, abs=1e-4)
