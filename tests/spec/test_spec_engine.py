"""N-gram speculative decoding in the engine (SmolLM2 from its embedded GGUF, float32 on CPU,
in process): greedy output is token for token the plain engine's with the same logprobs, a
stop token inside an accepted span cuts the output exactly there (max_tokens caps the drafts), the
prefix cache holds only verified KV (its pages equal the plain engine's, and a later turn hitting
them gives the plain tokens), pages and slots are all accounted for afterwards; seeded sampling
is reproducible; configurations speculation cannot run exactly are refused before any weight
is read."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import AddRequest, SamplingParams

NGRAM = SpeculativeConfig(algorithm="ngram", num_draft_tokens=4)
CFG = EngineConfig(
    cache=CacheConfig(max_total_tokens=4096, page_size=16),
    scheduler=SchedulerConfig(max_num_batched_tokens=128),
)
LIST = "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango"
COPY = f"Copy the list exactly.\nList: {LIST}.\nCopy: apple,"
_rid = itertools.count()


@pytest.fixture(scope="module")
def engines():
    plain = Engine(CFG)
    spec = Engine(dataclasses.replace(CFG, speculative=NGRAM), plain.src)
    return plain, spec


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return lambda text: smollm2_tokenizer.encode(text, add_special_tokens=False)


def _trace(engine: Engine, ids: list[int], params: SamplingParams):
    """Tokens, logprobs, finish reason and the output positions each step emitted."""
    rid = f"t{next(_rid)}"
    engine.add(AddRequest(rid, ids, params))
    toks, lps, steps, reason = [], [], [], None
    while engine.has_work:
        outs = [o for o in engine.step().outputs if o.rid == rid]
        assert all(o.error is None for o in outs), outs
        got = [t for o in outs for t in o.token_ids]
        if got:
            steps.append(range(len(toks), len(toks) + len(got)))
        toks += got
        lps += [x for o in outs for x in o.logprobs or []]
        reason = next((o.finish_reason for o in outs if o.finish_reason), reason)
    return toks, lps, reason, steps


def _idle(engine: Engine) -> None:
    engine.check_idle_integrity()
    engine.flush_prefix_cache()
    assert engine.scheduler.page_pool.num_used == 0


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "logprobs": 1, **kw})


def test_a_limit_or_a_stop_inside_an_accepted_span_cuts_the_output_there(engines, tok):
    plain, spec = engines
    ids = tok(COPY)
    want, want_lps, _, _ = _trace(plain, ids, _greedy())
    accepted = spec.drafter.stats.num_accepted_tokens
    got, lps, _, steps = _trace(spec, ids, _greedy())
    assert got == want
    assert lps == pytest.approx(want_lps, abs=1e-4)
    assert spec.drafter.stats.num_accepted_tokens - accepted >= len(want) // 2  # a copy
    # max_tokens ending on the second token of a step that emitted three or more: the drafts
    # are capped (the bonus token is the last one allowed).
    span = next(s for s in steps if len(s) >= 3)
    cut = span[1] + 1
    out, _, reason, cut_steps = _trace(spec, ids, _greedy(max_tokens=cut))
    assert (out, reason) == (want[:cut], "length")
    assert cut_steps[-1] == range(span[0], cut)
    # A stop token that occurs nowhere earlier in the output, inside an accepted span: the
    # tokens the step accepted after it are dropped.
    span, at = next((s, p) for s in steps for p in s[:-1] if want[p] not in want[:p])
    # (plain decoding stops on the token's first occurrence: want[: at + 1])
    out, _, reason, stop_steps = _trace(spec, ids, _greedy(stop_token_ids=(want[at],)))
    assert (out, reason) == (want[: at + 1], "stop")
    assert stop_steps[-1] == range(span[0], at + 1)
    _idle(spec)


def test_a_mixed_batch_gives_the_plain_tokens(engines, tok):
    """Penalties and min_tokens read each drafted row's own output so far; logprobs with
    alternatives, ignore_eos, a prompt chunked over steps."""
    plain, spec = engines
    prompts = [
        tok(COPY),
        tok(COPY.replace("apple", "pear")),
        tok(("The sea was calm. The sky was grey. " * 12) + "The sea"),  # a chunked prompt
    ]
    params = [
        _greedy(logprobs=3, max_tokens=20),
        _greedy(presence_penalty=0.4, frequency_penalty=0.2, min_tokens=18, max_tokens=20),
        _greedy(ignore_eos=True, max_tokens=17, logprobs=None),
    ]
    want = generate(plain, prompts, params)
    before = spec.drafter.stats.num_accepted_tokens
    got = generate(spec, prompts, params)
    assert spec.drafter.stats.num_accepted_tokens > before
    for w, g in zip(want, got, strict=True):
        assert [t for o in g for t in o.token_ids] == [t for o in w for t in o.token_ids]
        assert [o.finish_reason for o in g] == [o.finish_reason for o in w]
        lp = lambda outs: [x for o in outs for x in o.logprobs or []]
        assert lp(g) == pytest.approx(lp(w), abs=1e-4)
        top = lambda outs: [[t.token_id for t in x] for o in outs for x in o.top_logprobs or []]
        assert top(g) == top(w)
    _idle(spec)


def _cached_kv(engine: Engine, tokens: list[int]) -> torch.Tensor:
    pages, _ = engine.scheduler.prefix.match(tokens)
    return torch.stack([torch.stack([k[pages], v[pages]]) for k, v in engine.runner.pool.layers])


def test_the_prefix_cache_holds_only_verified_kv(engines, tok):
    """Turn 1's output pages (written by verify steps, rejected drafts included) are cached with
    the plain engine's KV; turn 2 hits them and gives the plain tokens."""
    plain, spec = engines
    ids = tok(COPY.replace("apple", "plum"))
    want, _, _, _ = _trace(plain, ids, _greedy(max_tokens=36))
    got, _, _, _ = _trace(spec, ids, _greedy(max_tokens=36))
    assert got == want
    turn = ids + want
    kv_plain, kv_spec = _cached_kv(plain, turn), _cached_kv(spec, turn)
    assert kv_spec.shape == kv_plain.shape and kv_spec.shape[2] * 16 > len(ids) + 16
    torch.testing.assert_close(kv_spec, kv_plain, atol=1e-4, rtol=1e-4)
    turn2 = turn + tok("\nNow copy it again.\nCopy: plum,")
    hits = spec.scheduler.prefix.hit_tokens
    want2, _, _, _ = _trace(plain, turn2, _greedy(max_tokens=12))
    got2, _, _, _ = _trace(spec, turn2, _greedy(max_tokens=12))
    assert got2 == want2
    assert spec.scheduler.prefix.hit_tokens - hits > len(ids)  # output pages were hits
    _idle(spec)


def test_seeded_sampling_is_reproducible_and_valid(engines, tok):
    """Temperature > 0 verifies drafts by rejection sampling (spec/acceptance.py, tested for
    the target distribution there): the same seed gives the same tokens."""
    _, spec = engines
    ids = tok(COPY)
    p = SamplingParams(temperature=0.7, top_p=0.95, seed=11, max_tokens=12, logprobs=0)
    a, lps, reason, _ = _trace(spec, ids, p)
    assert _trace(spec, ids, p)[0] == a
    assert reason in ("stop", "length") and len(lps) == len(a) and all(x <= 0 for x in lps)
    _idle(spec)


@pytest.mark.parametrize(
    "model,spec,match",
    [
        ("qwen3-tiny", dataclasses.replace(NGRAM, algorithm="mtp"), "needs a model with an MTP"),
        (
            "dsv4-tiny",
            dataclasses.replace(NGRAM, algorithm="mtp", num_draft_tokens=5),
            "chains its block at most 4 times",
        ),
        ("qwen3-tiny", dataclasses.replace(NGRAM, num_draft_tokens=0), "at least 1"),
        ("qwen3-tiny", dataclasses.replace(NGRAM, ngram_min=3, ngram_max=2), "window sizes"),
        ("qwen3-tiny", dataclasses.replace(NGRAM, disable_batch_size=-1), "0 \\(never\\)"),
    ],
)
def test_what_speculation_cannot_run_is_refused_at_start(model, spec, match):
    with pytest.raises(ValueError, match=match):
        Engine(EngineConfig(model=model, load_format="dummy", speculative=spec))


def test_the_cli_default_k_follows_the_algorithm():
    from kvrelay.cli import build_parser, engine_config

    def k(*args: str) -> int:
        return engine_config(
            build_parser().parse_args(["serve", *args])
        ).speculative.num_draft_tokens

    assert k("--speculative-algorithm", "ngram") == 4
    assert k("--speculative-algorithm", "mtp") == 4  # MTP_DEFAULT_DRAFTS
    assert k("--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", "1") == 1
    assert k("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "0") == 0
    cfg = engine_config(
        build_parser().parse_args(["serve", "--speculative-disable-batch-size", "16"])
    )
    assert cfg.speculative.disable_batch_size == 16
