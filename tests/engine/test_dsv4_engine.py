"""DeepSeek-V4 through the engine (paged pools, state slots, scheduler) against its own
full-sequence forward: chunked prefill at any chunk size, prefill + decode, batched vs alone,
preemption. The full forward itself is checked against HF and a float64 oracle in tests/models.

QAT simulation is off here: its FP8/FP4 roundings turn last-bit GEMM differences between
differently shaped batches into visible ones, which would hide real cache bugs behind a loose
tolerance. One test keeps it on and checks greedy tokens only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.weights.loader import resolve

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend

TOL = 1e-4  # relative to the logits' scale
VOCAB = resolve("dsv4-tiny", "dummy").config.vocab_size  # widened to the borrowed tokenizer's


def make_engine(qat: bool = False, max_tokens: int = 8192, budget: int = 2048, **cache) -> Engine:
    src = resolve("dsv4-tiny", "dummy")
    src = dataclasses.replace(src, config=src.config.with_(qat_simulation=qat))
    cfg = EngineConfig(
        model="dsv4-tiny",
        load_format="dummy",
        device="cpu",
        dtype="float32",
        cache=CacheConfig(max_total_tokens=max_tokens, **cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, kv_reserve_ratio=0.0),
    )
    return Engine(cfg, src)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def chunked_logits(engine: Engine, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits of every position, prefilled `chunk` tokens at a time through the paged cache."""
    r, sched = engine.runner, engine.scheduler
    req = Request("chunked", ids, SamplingParams(max_tokens=1), 0)
    req.state_slot = sched.slot_pool.alloc(1)[0]
    out = []
    try:
        while req.num_computed < len(ids):
            n = min(chunk, len(ids) - req.num_computed)
            need = -(-(req.num_computed + n) // r.page_size) - len(req.pages)
            req.pages += sched.page_pool.alloc(need)
            out.append(r.forward([ScheduledRequest(req, n)], all_rows=True))
            req.num_computed += n
    finally:
        sched.page_pool.free(req.pages)
        sched.slot_pool.free([req.state_slot])
    return torch.cat(out)


def test_page_size_covers_every_ratio(engine: Engine) -> None:
    c = engine.runner.model_cfg
    assert engine.runner.page_size % c.hca_compress_ratio == 0
    assert engine.runner.page_size % c.csa_compress_ratio == 0


# 150 tokens: the 16-token window is full, 9 ratio-16 and 37 ratio-4 entries exist, and the
# indexer (top-8) drops most of them; chunks of 3 and 7 end mid-window and mid-page.
@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 150])
def test_chunked_prefill_equals_full_forward(engine: Engine, chunk: int) -> None:
    ids = prompt(150, seed=1)
    full = engine.runner.model(torch.tensor(ids))
    got = chunked_logits(engine, ids, chunk)
    scale = full.abs().max().item()
    assert (got - full).abs().max().item() <= TOL * scale
    engine.check_idle_integrity()


def test_prefill_then_64_decode_steps_equal_full_forward(engine: Engine) -> None:
    ids = prompt(70, seed=2)
    p = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = generate(engine, [ids], p)[0]
    toks = [t for o in outs for t in o.token_ids]
    lps = [lp for o in outs for lp in o.logprobs or []]
    assert len(toks) == 64
    full = engine.runner.model(torch.tensor(ids + toks[:-1])).log_softmax(-1)
    rows = full[len(ids) - 1 :]  # the row that predicted each generated token
    assert rows.argmax(-1).tolist() == toks
    want = rows.gather(1, torch.tensor(toks)[:, None]).squeeze(1)
    assert (torch.tensor(lps) - want).abs().max().item() < 1e-4
    engine.check_idle_integrity()


def test_sixteen_batched_equal_each_alone(engine: Engine) -> None:
    # Mixed lengths, some longer than the step budget's share, so prefill chunks and decode
    # steps of different requests share forward passes.
    prompts = [prompt(n, seed=10 + i) for i, n in enumerate([5, 17, 33, 64, 90, 130] * 3)][:16]
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    batched = [[t for o in outs for t in o.token_ids] for outs in generate(engine, prompts, p)]
    alone = [[t for o in generate(engine, [ids], p)[0] for t in o.token_ids] for ids in prompts]
    assert batched == alone
    engine.check_idle_integrity()
    assert engine.scheduler.slot_pool.num_used == 0


def test_preemption_recomputes_the_same_tokens() -> None:
    tight = make_engine(max_tokens=256, budget=64)  # 16 pages of 16: preemption must happen
    prompts = [prompt(n, seed=40 + i) for i, n in enumerate([40, 60, 50, 30])]
    p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = [[t for o in outs for t in o.token_ids] for outs in generate(tight, prompts, p)]
    assert tight.scheduler.num_preemptions > 0
    roomy = make_engine(max_tokens=4096)
    want = [[t for o in outs for t in o.token_ids] for outs in generate(roomy, prompts, p)]
    assert got == want
    tight.check_idle_integrity()
    assert tight.scheduler.slot_pool.num_used == 0


def test_qat_on_chunked_greedy_tokens_match() -> None:
    eng = make_engine(qat=True, budget=7)  # 7-token prefill chunks
    ids = prompt(60, seed=3)
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = [t for o in generate(eng, [ids], p)[0] for t in o.token_ids]
    seq = list(ids)
    for _ in range(16):  # the full forward, greedy, one token at a time
        seq.append(int(eng.runner.model(torch.tensor(seq))[-1].argmax()))
    assert got == seq[len(ids) :]


def test_fp8_index_keys_round_trip_within_fp8_error() -> None:
    eng = make_engine(index_k_dtype="fp8")
    pool = eng.runner.cache
    layer = next(i for i, k in enumerate(pool.index_k) if k is not None)
    pages = torch.tensor(eng.scheduler.page_pool.alloc(2))
    rows = torch.randn(8, pool.cfg.index_head_dim) * torch.logspace(-2, 2, 8)[:, None]
    pool._write_index_k(layer, pages, 0, rows)
    back = pool._read_index_k(layer, pages, 8)
    rel = ((back - rows).abs().amax(-1) / rows.abs().amax(-1)).max().item()
    assert rel <= 2**-4  # e4m3 has 3 mantissa bits: half an ulp at the row max is 2^-4
    # and it serves: the same greedy run completes with fp8 keys
    out = generate(eng, [prompt(50, seed=5)], SamplingParams(max_tokens=4, temperature=0.0))
    assert sum(len(o.token_ids) for o in out[0]) >= 1
    eng.scheduler.page_pool.free(pages.tolist())
    eng.check_idle_integrity()
