"""Speculative decoding on DeepSeek-V4 (dsv4-tiny, random weights, float32 on CPU, QAT off, in
process):
a rejected draft leaves no trace in any state the model keeps.

A verify step runs the drafts through every layer: their sliding-window rows, the compressors'
open windows (CSA ratio 4 with overlap, HCA ratio 16 here), the entries of windows they close and
the indexer's keys. Nothing is copied back: a state slot keeps two windows, so a rejected
draft's rows land where nothing reads them before their positions are computed again
(cache_pool.py; test_dsv4_rejected_close.py checks it at one compress step). Checked here with
drafts built from the plain engine's own greedy output with one planted error at every offset
(so that steps accept all, some or none of the drafts, and the rejected ones close windows of
both ratios): the tokens and logprobs are the plain engine's, every page and slot is accounted
for afterwards. (The n-gram drafter on real weights: test_spec_dsv4_served.py; random weights
rarely repeat themselves.)
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch
from eager_graphs import use_eager_graphs

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from kvrelay.engine.drafter import draft_room
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.weights.loader import resolve

K = 4
AGENT = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "dsv4-tiny-agent"
NGRAM = SpeculativeConfig(algorithm="ngram", num_draft_tokens=K)
# QAT off (as in test_dsv4_engine): its FP8/FP4 roundings turn the ulps by which rows computed in
# chunks of another size differ into whole rounding steps (logprobs 1e-3 apart, measured)
_SRC = resolve("dsv4-tiny", "dummy")
SRC = dataclasses.replace(_SRC, config=_SRC.config.with_(qat_simulation=False))
VOCAB = SRC.config.vocab_size
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend


def _engine(spec: SpeculativeConfig | None = None, backend: str = "auto") -> Engine:
    cfg = EngineConfig(
        model="dsv4-tiny",
        load_format="dummy",
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        cache=CacheConfig(page_size=16, max_total_tokens=8192),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, kv_reserve_ratio=0.0),
    )
    if spec is not None:
        cfg = dataclasses.replace(cfg, speculative=spec)
    return Engine(cfg, SRC)


@pytest.fixture(scope="module")
def plain() -> Engine:
    return _engine()


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    lens = [37, 61, 18, 90, 45, 29, 70, 52][:n]
    return [torch.randint(0, VOCAB, (m,), generator=g).tolist() for m in lens]


def _greedy(max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def _logprobs(outs) -> list[float]:
    return [x for o in outs for x in o.logprobs or []]


def _close(got, want) -> None:
    """Logprobs of rows computed in chunks of other sizes (a verify step's rows): the fp32 sums
    run in another order (measured: 3e-5 at most); a leaked draft moves the attention's inputs
    themselves (an entry pooled over a wrong token, a window row), and with them the logprobs
    by far more."""
    assert got == pytest.approx(want, abs=1e-4)


def _planted(want: dict[tuple[int, ...], list[int]]):
    """A drafter proposing the plain engine's next tokens for the request's prompt, the one at
    offset e wrong, e cycling over 0..K (K: no error, all accepted)."""
    offsets = itertools.cycle(range(K + 1))

    def propose(req, budget: int) -> list[int]:
        out = want[tuple(req.prompt_ids)]
        pos = len(req.output_ids)
        draft = list(out[pos : pos + draft_room(req, K, budget, 1 << 30)])
        e = next(offsets)
        if e < len(draft):
            draft[e] = (draft[e] + 1) % VOCAB
        return draft

    return propose


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("concurrency", [1, 8])
def test_rejected_drafts_leave_no_trace(plain, backend: str, concurrency: int) -> None:
    ref = plain if backend == "auto" else _engine(backend=backend)
    spec = _engine(NGRAM, backend)
    prompts = _prompts(concurrency)
    want = generate(ref, prompts, _greedy())
    spec.scheduler.drafter = _planted(
        {tuple(p): _tokens(w) for p, w in zip(prompts, want, strict=True)}
    )
    got = generate(spec, prompts, _greedy())
    stats = spec.drafter.stats
    for w, g in zip(want, got, strict=True):
        assert _tokens(g) == _tokens(w)
        _close(_logprobs(g), _logprobs(w))
    # every kind of step happened: all drafts accepted, some, none
    assert stats.num_drafts > 10 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_pos[K - 1] > 0 and stats.accepted_per_pos[0] < stats.num_drafts
    spec.check_idle_integrity()
    spec.flush_prefix_cache()
    assert spec.scheduler.page_pool.num_used == 0


@pytest.mark.parametrize("concurrency", [1, 8])
def test_rejected_drafts_that_close_windows_give_the_plain_tokens(plain, concurrency: int) -> None:
    """Planted errors at every offset make rejected drafts close windows of both ratios (4 and
    16) and fall mid-window; the request goes on from its first rejected position without
    computing anything again, and its tokens and logprobs are plain's."""
    spec = _engine(NGRAM)
    prompts = _prompts(concurrency)
    want = generate(plain, prompts, _greedy())
    spec.scheduler.drafter = _planted(
        {tuple(p): _tokens(w) for p, w in zip(prompts, want, strict=True)}
    )
    drafted: dict[str, tuple[int, int]] = {}  # rid -> (tokens as its verify step began, drafts)
    rejected: list[range] = []

    def watched(schedule=spec.scheduler.schedule):
        batch, unfittable = schedule()
        drafted.update({s.req.rid: (s.req.num_tokens, len(s.draft)) for s in batch if s.draft})
        return batch, unfittable

    def settled(req, settle=spec.scheduler.settle_verified) -> None:
        before, k = drafted.pop(req.rid)  # rows at positions before - 1 .. before - 1 + k
        rejected.append(range(req.num_tokens - 1, before + k))
        settle(req)

    spec.scheduler.schedule, spec.scheduler.settle_verified = watched, settled
    got = generate(spec, prompts, _greedy())
    for w, g in zip(want, got, strict=True):
        assert _tokens(g) == _tokens(w)
        _close(_logprobs(g), _logprobs(w))
    for r in (4, 16):
        assert any((j + 1) % r == 0 for rej in rejected for j in rej), r
    assert any(rej and all((j + 1) % 4 for j in rej) for rej in rejected)  # mid-window only
    spec.check_idle_integrity()


def test_draft_tokens_past_the_smallest_ratio_are_refused() -> None:
    """A state slot keeps two windows: a verify step's rows may not span more."""
    with pytest.raises(ValueError, match="at most 4 drafts a step"):
        _engine(dataclasses.replace(NGRAM, num_draft_tokens=5))


def test_tensor_parallel_speculation_is_refused() -> None:
    cfg = EngineConfig(
        model="dsv4-tiny", load_format="dummy", device="cpu", tensor_parallel_size=2,
        speculative=NGRAM,
    )  # fmt: skip
    with pytest.raises(ValueError, match="not supported for DeepSeek-V4 with tensor parallel"):
        Engine(cfg)


MTP = SpeculativeConfig(algorithm="mtp", num_draft_tokens=1)


@pytest.mark.parametrize("concurrency,k", [(1, 1), (8, 1), (8, 3)])
def test_mtp_drafts_give_the_plain_tokens(plain, concurrency: int, k: int) -> None:
    """The MTP block (random here: its drafts are mostly wrong) drafts from every step's rows,
    chained k times; what is verified is the plain output, whatever the drafts."""
    spec = _engine(dataclasses.replace(MTP, num_draft_tokens=k))
    prompts = _prompts(concurrency)
    want = generate(plain, prompts, _greedy())
    got = generate(spec, prompts, _greedy())
    for w, g in zip(want, got, strict=True):
        assert _tokens(g) == _tokens(w)
        _close(_logprobs(g), _logprobs(w))
    stats = spec.drafter.stats
    assert stats.num_drafts > 10
    # chained: k drafts a step where a request decodes (fewer near max_tokens)
    assert (
        stats.num_draft_tokens > stats.num_drafts
        if k > 1
        else stats.num_draft_tokens == stats.num_drafts
    )
    spec.check_idle_integrity()
    spec.flush_prefix_cache()
    assert spec.scheduler.page_pool.num_used == 0


def test_mtp_without_weights_or_on_the_reference_path_is_refused() -> None:
    with pytest.raises(ValueError, match="attention-backend reference"):
        _engine(MTP, backend="reference")
    if AGENT.is_dir():  # an HF checkpoint without an MTP block, none given
        cfg = EngineConfig(model=str(AGENT), device="cpu", dtype="float32", speculative=MTP)
        with pytest.raises(ValueError, match="has no MTP block"):
            Engine(cfg)


@pytest.mark.parametrize("algorithm,k", [("ngram", K), ("mtp", 1), ("mtp", 3)])
def test_verify_steps_and_the_mtp_pass_through_the_graph_buffers(
    plain, algorithm: str, k: int
) -> None:
    """Verify steps (up to 1 + k rows per request, mixed counts through filler rows) and the
    MTP pass (chained k times) through the decode graphs' static buffers, padding and buckets
    (run eagerly: CPU has no CUDA graphs; tests/gpu replays them): the plain tokens and
    logprobs."""
    spec = _engine(NGRAM if algorithm == "ngram" else dataclasses.replace(MTP, num_draft_tokens=k))
    graphs = use_eager_graphs(spec)
    prompts = _prompts(8)
    want = generate(plain, prompts, _greedy())
    if algorithm == "ngram":
        spec.scheduler.drafter = _planted(
            {tuple(p): _tokens(w) for p, w in zip(prompts, want, strict=True)}
        )
    got = generate(spec, prompts, _greedy())
    for w, g in zip(want, got, strict=True):
        assert _tokens(g) == _tokens(w)
        _close(_logprobs(g), _logprobs(w))
    stats = spec.drafter.stats
    assert stats.num_drafts > 10 and stats.num_accepted_tokens < stats.num_draft_tokens
    qs = {q for _, _, q in graphs.graphs}
    assert max(qs) == k + 1  # none past K + 1 rows per request
    assert len(qs) >= 2 or algorithm == "mtp"  # (mtp: k drafts from every decode step on)
    assert {bs for bs, _, _ in graphs.graphs} >= {8}
    spec.check_idle_integrity()


@pytest.mark.parametrize("algorithm,k", [("ngram", K), ("mtp", 3)])
def test_deterministic_speculation_is_bitwise_plain(algorithm: str, k: int) -> None:
    """With --deterministic (batch-invariant mode: a row's bits do not depend on the rows beside
    it) a verify step's rows are computed as plain decoding computes them: in bf16 with QAT on,
    the tokens and logprobs of speculative decoding (planted n-gram drafts; the MTP block
    chained) are bitwise the plain ones."""
    src = resolve("dsv4-tiny", "dummy")

    def engine(spec: SpeculativeConfig | None) -> Engine:
        cfg = EngineConfig(
            model="dsv4-tiny", load_format="dummy", device="cpu", dtype="bfloat16",
            deterministic=True, cache=CacheConfig(page_size=16, max_total_tokens=8192),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, kv_reserve_ratio=0.0),
        )  # fmt: skip
        return Engine(cfg if spec is None else dataclasses.replace(cfg, speculative=spec), src)

    prompts = _prompts(4)
    want = generate(engine(None), prompts, _greedy(24))
    spec_cfg = NGRAM if algorithm == "ngram" else dataclasses.replace(MTP, num_draft_tokens=k)
    spec = engine(spec_cfg)
    if algorithm == "ngram":
        spec.scheduler.drafter = _planted(
            {tuple(p): _tokens(w) for p, w in zip(prompts, want, strict=True)}
        )
    got = generate(spec, prompts, _greedy(24))
    for w, g in zip(want, got, strict=True):
        assert _tokens(g) == _tokens(w)
        assert _logprobs(g) == _logprobs(w)  # bitwise
    assert spec.drafter.stats.num_drafts > 5
    spec.check_idle_integrity()
