"""A grammar-constrained request under PD: prefill samples the first token under the grammar, the
decode side's matcher catches up with that token (it never went through decode's sampler) and
the rest follows as in one engine (qwen3-tiny, dummy weights, greedy)."""

from __future__ import annotations

import re

import pytest
from engine_pair import dense_engine, pairs

from kvrelay.engine.engine import generate
from kvrelay.engine.messages import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend

llguidance = pytest.importorskip("llguidance")
PATTERN = r"(cat|dog)( (cat|dog)){2,3}\."


def test_constrained_pd_equals_single_engine() -> None:
    from llguidance import LLMatcher

    params = SamplingParams(
        max_tokens=24, temperature=0.0, grammar=LLMatcher.grammar_from_regex(PATTERN)
    )
    prompts = [[(7 * i + 3 * j) % 1000 + 10 for j in range(n)] for i, n in enumerate([5, 40])]
    single = dense_engine("single")
    want = generate(single, prompts, params)
    tok = single.grammar.tokenizer
    for w in want:
        text = tok.decode_str([t for o in w for t in o.token_ids])
        assert re.fullmatch(PATTERN, text) and w[-1].finish_reason == "stop", text
    with pairs() as make:
        pair = make(dense_engine("prefill"), dense_engine("decode"))
        rids = [f"r{i}" for i in range(len(prompts))]
        for rid, ids in zip(rids, prompts, strict=True):
            pair.submit(rid, ids, params)
        pair.pump(lambda: all(pair.finished("decode", r) for r in rids))
        for rid, w in zip(rids, want, strict=True):
            got = pair.outs[("decode", rid)]
            assert [t for o in got for t in o.token_ids] == [t for o in w for t in o.token_ids]
            assert got[-1].finish_reason == "stop" and got[-1].error is None
        pair.assert_clean()
