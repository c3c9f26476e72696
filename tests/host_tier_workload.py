"""The host tier's workload, shared by the CPU engine tests and the GPU test: conversations that
share a trunk, run so that a device pool of about two conversations must push earlier pages to
host memory and later turns must load them back."""

from __future__ import annotations

import torch

from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=0)


def random_ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def workload(engine: Engine) -> list[tuple[list[int], list[float], int]]:
    """4 conversations (a shared trunk of 2.5 pages, 3 pages of their own) one at a time;
    their second turns one at a time; then 16 third turns in one batch. Per request: (tokens,
    logprobs, cached tokens)."""
    vocab, p = engine.src.config.vocab_size, engine.runner.page_size
    trunk = random_ids(2 * p + p // 2, 1, vocab)
    first = [trunk + random_ids(3 * p, 10 + i, vocab) for i in range(4)]
    second = [ids + random_ids(p // 2 + 1, 20 + i, vocab) for i, ids in enumerate(first)]
    third = [second[i % 4] + random_ids(1 + i % p, 30 + i, vocab) for i in range(16)]
    outs = [generate(engine, [ids], PARAMS)[0] for ids in first + second]
    outs += generate(engine, third, PARAMS)
    return [
        (
            [t for o in out for t in o.token_ids],
            [lp for o in out for lp in o.logprobs],
            out[0].num_cached_tokens,
        )
        for out in outs
    ]


def tokens_of(results) -> list[list[int]]:
    return [r[0] for r in results]
