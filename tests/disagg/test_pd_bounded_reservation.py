"""Decode reserves bounded KV for a transfer too: two PD requests without max_tokens fit on a
decode whose pool holds one whole context, and both end with the tokens of one engine (the
newer one is preempted on decode when the pool runs dry, and recomputed there)."""

from __future__ import annotations

import pytest
from engine_pair import PD_SECRET, pairs

from kvrelay.config import CacheConfig, DisaggConfig, EngineConfig, SchedulerConfig
from kvrelay.disagg.connector import make_agent
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

A = [(13 * j) % 5000 + 100 for j in range(40)]
B = [(7 * j + 1) % 5000 + 100 for j in range(24)]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a 2-layer model: tiny ops


def _engine(role: str, pool_tokens: int) -> Engine:
    return Engine(
        EngineConfig(
            model="qwen3-tiny",
            load_format="dummy",
            role=role,
            max_model_len=160,
            cache=CacheConfig(max_total_tokens=pool_tokens, page_size=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, kv_reserve_max_tokens=32),
            disagg=DisaggConfig(pd_secret=PD_SECRET),
        ),
        make_agent=make_agent,
    )


def _no_limit(ids: list[int]) -> SamplingParams:
    """What the API asks for when a request names no max_tokens: the rest of the context."""
    return SamplingParams(max_tokens=160 - len(ids), temperature=0.0, ignore_eos=True)


def test_two_requests_without_max_tokens_share_a_small_decode_pool() -> None:
    single = _engine("single", 640)
    want = [
        [t for o in generate(single, [ids], _no_limit(ids))[0] for t in o.token_ids]
        for ids in (A, B)
    ]
    with pairs() as make:
        pr = make(_engine("prefill", 640), _engine("decode", 160))  # decode: one context
        pr.submit("a", A, _no_limit(A))
        pr.submit("b", B, _no_limit(B))
        pr.pump(lambda: pr.finished("decode", "a") and pr.finished("decode", "b"), timeout=120)
        for rid, w in zip("ab", want, strict=True):
            got = pr.outs[("decode", rid)]
            assert got[-1].finish_reason == "length" and got[-1].error is None, got[-1]
            assert [t for o in got for t in o.token_ids] == w, rid
        assert pr.d.scheduler.num_preemptions > 0  # the pool ran dry: b recomputed on decode
        pr.assert_clean()
