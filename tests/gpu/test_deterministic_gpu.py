"""`--deterministic` on the GPU: the Triton path with CUDA graphs gives a request the same bits
alone as among others. bf16, random weights (smollm2-135m dummy, and dsv4-tiny with NVFP4 experts
and the QAT roundings: a request's bits, not its quality, are under test), a 64-token step budget
so prompts are chunked and share steps with other requests' decodes, decode steps replayed from
graphs (buckets 1..64).

Each of three requests (greedy long, sampled long, greedy short) alone, then among 16 and among
64 requests of mixed lengths: tokens, logprobs and top logprobs bitwise equal. The same run
without the mode is reported beside it, not asserted (whether cuBLAS and split-K decode vary
with the batch is theirs to choose)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.weights.loader import resolve

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NEW = 12
ALONE = [0, 1, 2]  # long greedy, long sampled, short greedy


def make_engine(deterministic: bool, model: str = "smollm2-135m", prefix_cache=False) -> Engine:
    src = resolve(model, "dummy")
    if model.startswith("dsv4"):
        src = dataclasses.replace(
            src, config=src.config.with_(expert_format="nvfp4", qat_simulation=True)
        )
    return Engine(
        EngineConfig(
            model=model,
            load_format="dummy",
            dtype="bfloat16",
            deterministic=deterministic,
            cuda_graphs=True,
            cache=CacheConfig(
                max_total_tokens=65536, prefix_cache=prefix_cache
            ),  # off: all computed
            scheduler=SchedulerConfig(max_num_batched_tokens=64),
        ),
        src,
    )


def workload(n: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(1)
    lens = [300, 200, 5] + torch.randint(1, 400, (n - 3,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (m,), generator=g).tolist() for m in lens]
    params = [
        SamplingParams(
            max_tokens=NEW, temperature=float(i % 2), seed=100 + i, ignore_eos=True, logprobs=2
        )
        for i in range(n)
    ]
    return prompts, params


def results(outs):
    toks = [t for o in outs for t in o.token_ids]
    lps = [lp for o in outs for lp in o.logprobs or []]
    tops = [[(x.token_id, x.logprob) for x in top] for o in outs for top in o.top_logprobs or []]
    return toks, lps, tops


def differing(eng: Engine, n: int) -> list[int]:
    prompts, params = workload(n, eng.runner.model_cfg.vocab_size)
    together = [results(r) for r in generate(eng, prompts, params)]
    return [i for i in ALONE if results(generate(eng, [prompts[i]], [params[i]])[0]) != together[i]]


def test_alone_equals_among_16_and_64_bitwise():
    eng = make_engine(True)
    assert eng.runner.graphs is not None
    assert type(eng.runner.family.backend).__name__ == "InvariantTritonAttention"
    assert differing(eng, 16) == [] and differing(eng, 64) == []
    eng.check_idle_integrity()
    del eng
    plain = make_engine(False)
    print(f"without the mode: requests {differing(plain, 64)} of {ALONE} differ among 64")


def test_dsv4_alone_equals_among_16_and_64_bitwise():
    """DeepSeek-V4 on its Triton path in the mode (runnable.py `_pick_ops`: sparse
    MQA in one split, the MoE at one tile config, the mHC pre kernel at every size, the glue
    eager under the dispatch mode): the same three requests, the same bitwise equality. Where it
    fails, tests/gpu/test_dsv4_invariant_kernels.py checks each kernel alone."""
    eng = make_engine(True, "dsv4-tiny")
    assert eng.runner.graphs is not None
    kernels = eng.runner.family.kernels
    assert kernels is not None and not kernels.fuse_glue and kernels.hc_gates is None
    assert differing(eng, 16) == [] and differing(eng, 64) == []
    eng.check_idle_integrity()
    del eng
    plain = make_engine(False, "dsv4-tiny")
    print(f"dsv4 without the mode: requests {differing(plain, 64)} of {ALONE} differ among 64")
