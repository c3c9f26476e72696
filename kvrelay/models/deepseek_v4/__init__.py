"""DeepSeek-V4 (compressed sparse attention, mHC, hash/bias-routed MoE): config and model."""

from kvrelay.models.deepseek_v4.config import PRESETS, DeepseekV4Config, preset
from kvrelay.models.deepseek_v4.dummy import init_dummy_weights
from kvrelay.models.deepseek_v4.model import DeepseekV4ForCausalLM, DeepseekV4Model
from kvrelay.models.deepseek_v4.state import CompressorState, LayerState, SequenceState

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
