"""The model registry: every entry names code that exists and fits together, and the loader, the
engine and the server dispatch through it (directory claims, GGUF names, presets, runners and
their cache pools, chat formats)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig
from kvrelay.engine.runner import make_runner
from kvrelay.models import registry
from kvrelay.models.registry import DEEPSEEK_V4, DENSE, FAMILIES
from kvrelay.server.chat_format import ChatFormat
from kvrelay.weights.loader import build_model, resolve

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_every_entry_resolves_and_fits(fam: registry.ModelFamily) -> None:
    fields = (
        "model",
        "config",
        "build",
        "runnable",
        "rank_model",
        "cache",
        "presets",
        "dir_config",
    )
    loaded = {f: fam.load(f) for f in fields}
    assert all(callable(loaded[f]) for f in fields if f != "presets")
    assert fam.chat_format in (registry.DENSE_CHAT, registry.DSV4_CHAT)
    for name, cfg in loaded["presets"].items():
        assert isinstance(cfg, loaded["config"]), name
        assert cfg.architecture in fam.architectures, name
        assert registry.preset(name) == (fam, cfg)
    for arch in fam.architectures:
        assert registry.family(arch) is fam and registry.model_class(arch) is loaded["model"]


def test_architectures_and_gguf_names_belong_to_one_family() -> None:
    archs = [a for fam in FAMILIES for a in fam.architectures]
    assert len(archs) == len(set(archs))
    assert registry.gguf_architecture("qwen3") == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
        registry.gguf_architecture("mamba")
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*Deepseek"):
        registry.family("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="unknown dummy preset 'dsv4-huge'"):
        resolve("dsv4-huge", "dummy")


def test_directories_are_claimed_by_their_family(tmp_path: Path) -> None:
    def folder(name: str, rel: str, config: dict) -> str:
        (tmp_path / name / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name / rel).write_text(json.dumps(config))
        return str(tmp_path / name)

    hf = folder("hf", "config.json", {"architectures": ["DeepseekV4ForCausalLM"]})
    native = folder("native", "inference/config.json", {"dim": 64, "n_layers": 2, "o_groups": 2})
    dense = folder("dense", "config.json", {"architectures": ["Qwen3ForCausalLM"]})
    assert registry.family_for_dir(hf) is DEEPSEEK_V4
    assert registry.family_for_dir(native) is DEEPSEEK_V4
    assert registry.family_for_dir(dense) is DENSE


@pytest.mark.parametrize("preset", ["qwen3-tiny", "dsv4-tiny"])
def test_runner_model_cache_and_chat_format_come_from_the_entry(preset: str) -> None:
    src = resolve(preset, "dummy")
    fam = registry.family(src.config.architecture)
    assert fam is registry.preset(preset)[0]
    cfg = EngineConfig(
        model=preset, load_format="dummy", device="cpu", dtype="float32",
        cache=CacheConfig(max_total_tokens=512),
    )  # fmt: skip
    runner = make_runner(cfg, src)  # one runner class for every family; the family's side:
    assert isinstance(runner.family, fam.load("runnable"))
    assert isinstance(runner.model, fam.load("model"))
    pools = [v for v in vars(runner).values() if isinstance(v, fam.load("cache"))]
    assert len(pools) == 1  # the runner holds the cache pool its entry names
    model = build_model(src, torch.float32, torch.device("cpu"))
    assert type(model) is fam.load("model")
    assert ChatFormat(src.config.architecture, None).dsv4 == (fam.chat_format == registry.DSV4_CHAT)
