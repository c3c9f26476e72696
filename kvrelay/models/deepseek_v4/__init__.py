"""DeepSeek-V4 (compressed sparse attention, mHC, hash/bias-routed MoE): config and model.

The config (config.py) imports no torch and is imported here; the model, its dummy weights and
its state load on first use of their names (`registry.presets()`, which every `kvrelay` command
line asks for its --help text, reads the presets: a router or an API process needs no torch)."""

import importlib

from kvrelay.models.deepseek_v4.config import PRESETS, DeepseekV4Config, preset

_LAZY = {
    "init_dummy_weights": "kvrelay.models.deepseek_v4.dummy",
    "DeepseekV4ForCausalLM": "kvrelay.models.deepseek_v4.model",
    "DeepseekV4Model": "kvrelay.models.deepseek_v4.model",
    "CompressorState": "kvrelay.models.deepseek_v4.state",
    "LayerState": "kvrelay.models.deepseek_v4.state",
    "SequenceState": "kvrelay.models.deepseek_v4.state",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PRESETS",
    "CompressorState",
    "DeepseekV4Config",
    "DeepseekV4ForCausalLM",
    "DeepseekV4Model",
    "LayerState",
    "SequenceState",
    "init_dummy_weights",
    "preset",
]
