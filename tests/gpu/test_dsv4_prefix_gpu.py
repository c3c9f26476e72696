"""DeepSeek-V4's prefix cache on the GPU fast path (batched forward, Triton kernels, decode CUDA
graphs), float32: three turns per conversation, each resending the last one and its reply, so
later turns resume from pages written by Triton prefill and by graph-replayed decode (the
ratio-4 compressors' prev state kept at page ends included). Same greedy tokens and logprobs
within 1e-4 as the per-sequence torch reference path with the cache off."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.weights.loader import resolve

pytestmark = pytest.mark.gpu


def _engine(backend: str, prefix_cache: bool, device: str = "cuda") -> Engine:
    src = resolve("dsv4-tiny", "dummy")
    cfg = EngineConfig(
        model="dsv4-tiny",
        load_format="dummy",
        device=device,
        dtype="float32",
        attention_backend=backend,
        cache=CacheConfig(max_total_tokens=16384, prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )
    return Engine(cfg, dataclasses.replace(src, config=src.config.with_(qat_simulation=False)))


def _turns(engine: Engine) -> tuple[list, list, list[int]]:
    """Three turns of 6 conversations; (tokens, logprobs, cached tokens) of every request."""
    g = torch.Generator().manual_seed(5)
    vocab = engine.runner.model_cfg.vocab_size
    convs = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in (17, 40, 70, 99, 150)]
    convs.append(convs[-1][:120] + [1, 2, 3])  # shares 7 pages with the one before
    p = SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True, logprobs=0)
    toks, lps, cached = [], [], []
    for _ in range(3):
        outs = generate(engine, convs, p)
        for i, r in enumerate(outs):
            reply = [t for o in r for t in o.token_ids]
            toks.append(reply)
            lps.append([lp for o in r for lp in o.logprobs or []])
            cached.append(r[0].num_cached_tokens)
            convs[i] = convs[i] + reply + torch.randint(0, vocab, (9,), generator=g).tolist()
    return toks, lps, cached


def test_prefix_hits_on_the_fast_path_equal_the_reference_without_cache() -> None:
    ref = _engine("reference", prefix_cache=False)
    want = _turns(ref)
    del ref
    fast = _engine("auto", prefix_cache=True)
    assert fast.runner.graphs is not None
    got = _turns(fast)
    assert got[0] == want[0]
    delta = max(
        abs(x - y) for a, b in zip(got[1], want[1], strict=True) for x, y in zip(a, b, strict=True)
    )
    assert delta < 1e-4
    assert sum(got[2][6:]) > 6 * 2 * 64 and not any(want[2])  # turns 2 and 3 hit
    fast.check_idle_integrity()
