"""Read an HF model directory: config.json plus safetensors (single file or sharded with an index)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

from kvrelay.config import ModelConfig
from kvrelay.models import registry
from kvrelay.weights.tensor_source import SafetensorsReader, box_with, full_box


def read_config(path: str) -> ModelConfig:
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    arch = (c.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in registry.DENSE.architectures:  # other families have readers of their own
        supported = ", ".join(registry.DENSE.architectures)
        raise ValueError(f"unsupported architecture {arch!r} (supported: {supported})")
    heads = c["num_attention_heads"]
    eos = c.get("eos_token_id")
    rope = c.get("rope_scaling") or c.get("rope_parameters")
    theta = c.get("rope_theta") or (rope or {}).get("rope_theta", 10000.0)
    if rope and rope.get("rope_type", rope.get("type")) in (None, "default"):
        rope = None
    return ModelConfig(
        architecture=arch,
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=rope,
        max_position_embeddings=c.get("max_position_embeddings", 8192),
        tie_word_embeddings=c.get("tie_word_embeddings", False),
        attention_bias=c.get("attention_bias", arch == "Qwen2ForCausalLM"),
        qk_norm=arch == "Qwen3ForCausalLM",
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
    )


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {path}")
    return [os.path.join(path, n) for n in files]


def read_weights(
    path: str, shard_range=None, reader: SafetensorsReader | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor by name; with `shard_range(name, shape) -> (dim, start, stop) | None`
    (tensor parallel), only that slice of each tensor is read from the file (through `reader`,
    which tests instrument)."""
    from safetensors import safe_open

    if shard_range is None:
        for file in safetensors_files(path):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    reader = reader or SafetensorsReader()
    try:
        for file in safetensors_files(path):
            for name, shape in reader.shapes(file).items():
                r = shard_range(name, shape)
                box = full_box(shape) if r is None else box_with(shape, *r)
                yield name, reader.read(file, name, box)
    finally:
        reader.close()
