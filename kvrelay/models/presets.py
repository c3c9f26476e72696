"""Named dense configs for `--load-format dummy` (random weights, no download)."""

from __future__ import annotations

from kvrelay.config import ModelConfig

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, ModelConfig] = {
    # Llama-3.2-1B's shape: ~1.24B parameters.
    "llama-1b": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        eos_token_ids=(128001,),
    ),
    # SmolLM2-135M's shape, for quick tests without the GGUF.
    "smollm2-135m": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_ids=(2,),
    ),
    # A few-layer Qwen3-style model (qk-norm, untied) for tests.
    "qwen3-tiny": ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=1000000.0,
        max_position_embeddings=4096,
        qk_norm=True,
        eos_token_ids=(2,),
    ),
}
