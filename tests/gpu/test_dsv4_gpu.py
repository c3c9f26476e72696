"""DeepSeek-V4 through the engine on the GPU (torch reference path): the paged caches and state
slots give the full-sequence forward's logits there too, dense and NVFP4 experts, and the GPU
agrees with the CPU."""

from __future__ import annotations

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.weights.loader import resolve

pytestmark = pytest.mark.gpu


def _engine(device: str, expert_format: str = "dense", chunk: int = 7) -> Engine:
    src = resolve("dsv4-tiny", "dummy")
    c = src.config.with_(qat_simulation=False, expert_format=expert_format)
    src = type(src)(**{**src.__dict__, "config": c})
    cfg = EngineConfig(
        model="dsv4-tiny",
        load_format="dummy",
        device=device,
        dtype="float32",
        cache=CacheConfig(max_total_tokens=8192),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
    )
    return Engine(cfg, src)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 40, 150, 300)]


@pytest.mark.parametrize("expert_format", ["dense", "nvfp4"])
def test_engine_on_gpu_equals_full_forward(expert_format: str) -> None:
    eng = _engine("cuda", expert_format)
    p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    for ids, outs in zip(_prompts(), generate(eng, _prompts(), p), strict=True):
        toks = [t for o in outs for t in o.token_ids]
        lps = torch.tensor([lp for o in outs for lp in o.logprobs])
        full = eng.runner.model(torch.tensor(ids + toks[:-1], device="cuda")).log_softmax(-1)
        rows = full[len(ids) - 1 :]
        assert rows.argmax(-1).tolist() == toks
        want = rows.gather(1, torch.tensor(toks, device="cuda")[:, None]).squeeze(1).cpu()
        assert (lps - want).abs().max().item() < 1e-3
    eng.check_idle_integrity()


def test_gpu_matches_cpu_greedy() -> None:
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = []
    for device in ("cpu", "cuda"):
        outs = generate(_engine(device, chunk=64), _prompts(), p)
        runs.append([[t for o in out for t in o.token_ids] for out in outs])
    assert runs[0] == runs[1]
