"""Model families by architecture name: each entry names the model class, how its config is read
(checkpoint directory, GGUF metadata, dummy presets), its side of the runner contract
(models/base.py) and the cache pool it builds, and the chat format it speaks. Adding a model touches its folder and one entry here; the loader,
the engine and the server ask the registry instead of testing names or config types.

Entries name code as "module:attribute" strings, imported on use: weight readers (weights) and
chat formats (server) sit above models/ in the dependency order, and naming them here must not
import them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

DENSE_CHAT, DSV4_CHAT = "hf_template", "dsv4"  # chat formats (kvrelay.server.chat_format)


@dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]  # HF `architectures` names served by this family
    model: str  # the nn.Module class
    config: str  # its frozen config dataclass
    build: str  # (ModelSource, dtype, device, seed, max_positions) -> the model with weights
    # The family's side of the runner contract (models/base.py FamilyModel): (EngineConfig,
    # config, model, device, dtype, TPGroup) -> it; the engine's one runner drives it.
    runnable: str
    rank_model: str  # (EngineConfig, ModelSource, dtype, device, TPGroup) -> this rank's model
    cache: str  # the cache pool class it builds from its cache spec
    chat_format: str  # DENSE_CHAT (the tokenizer's template, JSON tool calls) | DSV4_CHAT (DSML)
    presets: str  # dict preset name -> config, for `--load-format dummy`
    dir_config: str  # (checkpoint directory) -> config
    claims_dir: str | None = None  # (directory) -> bool; None: any directory no family claims
    # GGUF `general.architecture` -> architecture, for families readable from GGUF files.
    gguf_architectures: dict[str, str] = field(default_factory=dict)
    # Served with a borrowed tokenizer (dummy weights, a directory without tokenizer files), the
    # config takes its BOS/EOS and, for dummy weights, a vocabulary covering its ids.
    adopts_borrowed_tokenizer: bool = False
    # The radix prefix cache can reuse this family's cached pages (kvrelay.cache.radix): a
    # page's content depends only on the tokens up to its end (DeepSeek-V4's pool keeps the
    # compressor state at page ends for this).
    prefix_cache: bool = True

    def load(self, attribute: str) -> Any:
        """The object an entry field names ("module:attribute")."""
        module, _, name = getattr(self, attribute).partition(":")
        return getattr(importlib.import_module(module), name)


DEEPSEEK_V4 = ModelFamily(
    name="deepseek_v4",
    architectures=("DeepseekV4ForCausalLM",),
    model="kvrelay.models.deepseek_v4.model:DeepseekV4ForCausalLM",
    config="kvrelay.models.deepseek_v4.config:DeepseekV4Config",
    build="kvrelay.weights.loader:build_dsv4",
    runnable="kvrelay.models.deepseek_v4.runnable:DeepseekV4Runnable",
    rank_model="kvrelay.weights.rank_model:dsv4_rank_model",
    cache="kvrelay.models.deepseek_v4.cache_pool:DeepseekV4CachePool",
    chat_format=DSV4_CHAT,
    presets="kvrelay.models.deepseek_v4.config:PRESETS",
    dir_config="kvrelay.weights.dsv4_config:read_config",
    claims_dir="kvrelay.weights.dsv4_config:is_dsv4_dir",
    adopts_borrowed_tokenizer=True,
)

DENSE = ModelFamily(
    name="llama",
    architectures=(
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ),
    model="kvrelay.models.llama.model:LlamaForCausalLM",
    config="kvrelay.config:ModelConfig",
    build="kvrelay.weights.loader:build_dense",
    runnable="kvrelay.models.llama.runnable:DenseRunnable",
    rank_model="kvrelay.weights.rank_model:dense_rank_model",
    cache="kvrelay.cache.kv_pool:KVPool",
    chat_format=DENSE_CHAT,
    presets="kvrelay.models.presets:PRESETS",
    dir_config="kvrelay.weights.hf_dir:read_config",
    gguf_architectures={
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    },
)

# Directory claims are asked in this order; a family without `claims_dir` (the dense one) takes
# whatever directory is left.
FAMILIES: tuple[ModelFamily, ...] = (DEEPSEEK_V4, DENSE)


def family(architecture: str) -> ModelFamily:
    for fam in FAMILIES:
        if architecture in fam.architectures:
            return fam
    known = sorted(a for fam in FAMILIES for a in fam.architectures)
    raise ValueError(f"unsupported architecture {architecture!r} (supported: {', '.join(known)})")


def family_for_dir(path: str) -> ModelFamily:
    """The family whose checkpoint directories `path` looks like."""
    for fam in FAMILIES:
        if fam.claims_dir is not None and fam.load("claims_dir")(path):
            return fam
    return next(fam for fam in FAMILIES if fam.claims_dir is None)


def gguf_architecture(gguf_arch: str) -> str:
    """GGUF `general.architecture` -> the architecture name it is served as."""
    table = {g: a for fam in FAMILIES for g, a in fam.gguf_architectures.items()}
    if gguf_arch not in table:
        raise ValueError(
            f"unsupported GGUF architecture {gguf_arch!r} (supported: {sorted(table)})"
        )
    return table[gguf_arch]


def presets() -> dict[str, tuple[ModelFamily, Any]]:
    """Every dummy preset: name -> (family, config)."""
    return {name: (fam, cfg) for fam in FAMILIES for name, cfg in fam.load("presets").items()}


def preset(name: str) -> tuple[ModelFamily, Any]:
    table = presets()
    if name not in table:
        raise ValueError(f"unknown dummy preset {name!r} (choose from {sorted(table)})")
    return table[name]


def model_class(architecture: str) -> type:
    return family(architecture).load("model")
