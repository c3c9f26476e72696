"""CUDA graph capture is not invalidated by CUDA calls on another thread (a PD transfer opening
IPC handles, a leftover engine): captures run in thread-local error mode. A thread allocates
fresh device memory (cudaMalloc, forbidden to every thread under a global-mode capture) while a
dense engine captures its graphs at start and a DeepSeek-V4 engine captures lazily mid-run; both
then produce the tokens their eager twins produce.

Quick tier (`pytest -m gpu`): [dsv4-tiny], the lazy capture mid-run (what a PD transfer thread
can race) on the served default (QAT on). [smollm2-135m] is gpu_full: a dense engine captures
its decode graphs at start, before it serves (the same thread-local capture; the dense graphs
are in the quick tier through test_engine_gpu.py, test_host_tier_gpu.py and
test_step_profile_gpu.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import tiered

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


class _Allocator(threading.Thread):
    """Keeps asking the driver for new memory on its own stream until stopped."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.calls = 0

    def run(self) -> None:
        stream = torch.cuda.Stream()
        size = 1 << 20
        with torch.cuda.stream(stream):
            while not self.stop.is_set():
                size += 1 << 20  # a new size each time: the caching allocator must call cudaMalloc
                buf = torch.empty(size, dtype=torch.uint8, device="cuda")
                buf.fill_(1)
                stream.synchronize()
                del buf
                self.calls += 1
                if size > 256 << 20:
                    size = 1 << 20


def _engine(model: str, graphs: bool) -> Engine:
    return Engine(
        EngineConfig(
            model=model,
            load_format="dummy",
            device="cuda",
            dtype="float32",
            cuda_graphs=graphs,
            cache=CacheConfig(max_total_tokens=8192),
            scheduler=SchedulerConfig(max_num_batched_tokens=256),
        )
    )


def _tokens(engine: Engine) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    vocab = engine.runner.model_cfg.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in [5, 33, 70]]
    return [[t for o in outs for t in o.token_ids] for outs in generate(engine, prompts, PARAMS)]


@tiered("model", ["smollm2-135m", "dsv4-tiny"], quick=["dsv4-tiny"])
def test_capture_survives_other_threads_cuda_calls(model):
    want = _tokens(_engine(model, graphs=False))
    noise = _Allocator()
    noise.start()
    try:
        engine = _engine(model, graphs=True)  # dense captures here, DeepSeek-V4 during the run
        got = _tokens(engine)
    finally:
        noise.stop.set()
        noise.join()
    assert noise.calls > 0
    assert got == want
