"""The engine on the GPU: Triton + CUDA graphs agree with the torch reference path and with eager."""

from __future__ import annotations

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

pytestmark = pytest.mark.gpu


def _run(backend: str, graphs: bool, chunk: int = 2048) -> list[list[int]]:
    eng = Engine(EngineConfig(
        model="smollm2-135m", load_format="dummy", dtype="float32", attention_backend=backend,
        cuda_graphs=graphs, cache=CacheConfig(max_total_tokens=16384),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
    ))
    g = torch.Generator().manual_seed(3)
    lens = [1, 7, 16, 17, 100, 257, 600, 1500]
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lens]
    outs = generate(eng, prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    eng.check_idle_integrity()
    return [[t for o in out for t in o.token_ids] for out in outs]


@pytest.fixture(scope="module")
def reference():
    return _run("torch", graphs=False)


def test_triton_with_cuda_graphs_matches_torch_reference(reference):
    assert _run("triton", graphs=True) == reference


def test_triton_eager_and_chunked_prefill_match(reference):
    assert _run("triton", graphs=False, chunk=64) == reference
