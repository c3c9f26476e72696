"""DeepSeek-V4 with the radix prefix cache (dsv4-tiny, random weights, CPU float32, QAT off as
in test_dsv4_engine): a page is a pure function of the tokens up to its end, and a request that
resumes from shared pages computes what the full forward computes.

- the bookkeeping: after any chunking, each full page keeps the overlapping compressors' prev
  state and the window rows that a run ending exactly at that page end leaves (both paths);
- a hit continues like the full forward (logprobs), for both attention paths, prefill chunks
  that straddle page ends, and pages holding several ratio-16 windows;
- property: random prompt trees through a small, evicting cache give the tokens a cache-off
  engine gives; a last test checks that they did evict and hit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.models.deepseek_v4.cache_pool import window_rows
from kvrelay.weights.loader import resolve

VOCAB = resolve("dsv4-tiny", "dummy").config.vocab_size
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend


def make_engine(backend: str = "auto", budget: int = 2048, page: int = 16, **cache) -> Engine:
    src = resolve("dsv4-tiny", "dummy")
    src = dataclasses.replace(src, config=src.config.with_(qat_simulation=False))
    cfg = EngineConfig(
        model="dsv4-tiny",
        load_format="dummy",
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        cache=CacheConfig(page_size=page, **{"max_total_tokens": 8192, **cache}),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, kv_reserve_ratio=0.0),
    )
    return Engine(cfg, src)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def prefill(engine: Engine, ids: list[int], chunk: int) -> Request:
    """Prefill `ids` through the runner `chunk` tokens at a time; the caller frees the request's
    pages and slot."""
    r, sched = engine.runner, engine.scheduler
    req = Request("prefill", ids, SamplingParams(max_tokens=1), 0)
    req.state_slot = sched.slot_pool.alloc(1)[0]
    while req.num_computed < len(ids):
        n = min(chunk, len(ids) - req.num_computed)
        need = -(-(req.num_computed + n) // r.page_size) - len(req.pages)
        req.pages += sched.page_pool.alloc(need)
        r.forward([ScheduledRequest(req, n)])
        req.num_computed += n
    return req


def release(engine: Engine, req: Request) -> None:
    engine.scheduler.page_pool.free(req.pages)
    engine.scheduler.slot_pool.free([req.state_slot])


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("chunk", [5, 23, 100])
def test_each_page_keeps_the_state_at_its_end(backend: str, chunk: int) -> None:
    eng = make_engine(backend)
    pool, p, w = eng.runner.cache, eng.runner.page_size, eng.runner.cache.window
    ids = prompt(100, seed=7)
    req = prefill(eng, ids, chunk)
    checked = 0
    for k in range(len(ids) // p):
        end = (k + 1) * p
        alone = prefill(eng, ids[:end], end)  # a run that ends exactly at this page end
        page, mine = req.pages[k], alone.pages[k]
        for s in pool.comp_slots + pool.index_slots:
            if s is not None and s.overlap:
                rows = window_rows(s.ratio, end // s.ratio - 1)  # the window closing at end
                for kept, slot in ((s.page_prev_kv, s.prev_kv), (s.page_prev_score, s.prev_score)):
                    torch.testing.assert_close(kept[page], slot[alone.state_slot, rows])
                    torch.testing.assert_close(kept[page], kept[mine])
                    checked += 1
        for swa in pool.swa:  # the window a continuation reads: the page end's last w - 1 rows
            rows = slice(p - (w - 1), p) if w - 1 <= p else slice(0, p)
            torch.testing.assert_close(swa[page, rows], swa[mine, rows])
        release(eng, alone)
    release(eng, req)
    assert checked > 0
    eng.check_idle_integrity()


@pytest.mark.parametrize(
    ("backend", "budget", "page"),
    [("torch", 7, 16), ("torch", 2048, 64), ("reference", 2048, 16), ("reference", 40, 64)],
)
def test_hit_continues_like_the_full_forward(backend: str, budget: int, page: int) -> None:
    eng = make_engine(backend, budget, page)
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    first = prompt(150, seed=1)
    out = generate(eng, [first], p)[0]
    assert all(o.num_cached_tokens == 0 for o in out)
    # turn 2 resends turn 1 and its reply (155 computed tokens), then 40 new ones
    ids = first + [t for o in out for t in o.token_ids] + prompt(40, seed=2)
    out = generate(eng, [ids], p)[0]
    assert out[0].num_cached_tokens == 155 // page * page
    toks = [t for o in out for t in o.token_ids]
    lps = torch.tensor([lp for o in out for lp in o.logprobs])
    full = eng.runner.model(torch.tensor(ids + toks[:-1])).log_softmax(-1)[len(ids) - 1 :]
    assert full.argmax(-1).tolist() == toks
    want = full.gather(1, torch.tensor(toks)[:, None]).squeeze(1)
    assert (lps - want).abs().max().item() < 1e-4
    eng.check_idle_integrity()
    assert eng.scheduler.slot_pool.num_used == 0


@pytest.fixture(scope="module")
def pair() -> tuple[Engine, Engine]:
    """Cache on with 16 pages of 16 (it evicts) and 40-token chunks; cache off, roomy.
    (Preemption with the cache on: test_dsv4_engine's preemption test.)"""
    return make_engine(budget=40, max_total_tokens=256), make_engine(prefix_cache=False)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    branches=st.lists(
        st.tuples(st.integers(0, 120), st.integers(1, 40), st.integers(0, 3)),
        min_size=1,
        max_size=3,
    )
)
def test_prompt_trees_give_the_tokens_of_a_cache_off_engine(pair, branches) -> None:
    """Each prompt: the first `cut` tokens of a common trunk, then its own tail; the cache-on
    engine keeps what earlier examples left, so hits come from any of them."""
    on, off = pair
    trunk = prompt(120, seed=3)
    prompts = [trunk[:cut] + prompt(n, seed=100 + s) for cut, n, s in branches]
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = generate(on, prompts, p)
    want = generate(off, prompts, p)
    assert [[t for o in g for t in o.token_ids] for g in got] == [
        [t for o in w for t in o.token_ids] for w in want
    ]
    for ids, outs in zip(prompts, got, strict=True):
        cached = outs[0].num_cached_tokens
        assert cached % on.runner.page_size == 0 and cached < len(ids)
    on.check_idle_integrity()
    assert on.scheduler.slot_pool.num_used == 0


def test_the_prompt_trees_hit_and_evicted(pair) -> None:
    on, _ = pair
    prefix = on.scheduler.prefix
    assert prefix.hit_tokens > 0 and prefix.evicted_pages > 0
