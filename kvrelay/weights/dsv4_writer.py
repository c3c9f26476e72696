"""Write a DeepSeek-V4 model as a checkpoint directory in one of the real layouts (tests and
benchmarks: tiny or dummy models saved the way DeepSeek or NVIDIA ship V4).

- "hf": HF-transformers names, tensors as the model holds them, HF config.json.
- "native": DeepSeek-native names (reference §6): FP8 e4m3 + ue8m0 128x128 `.scale` for the
  attention/indexer/shared-expert/MTP projections, MXFP4 routed experts (I8 + ue8m0 per 32),
  BF16 embeddings/norms/compressors/router, F32 mHC/sinks/ape/router bias, I64 tid2eid.
  Config: `inference/config.json` with native keys only.
- "nvfp4": as "native", but the routed experts of `layers.*` are NVFP4 (reference §7: U8 +
  e4m3 `.weight_scale` per 16 + F32 `.weight_scale_2` and `.input_scale`); the MTP experts stay
  MXFP4. Config: HF config.json with the ModelOpt mixed-precision quantization_config.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from torch import nn

from kvrelay.models.deepseek_v4.config import HASH_MOE, DeepseekV4Config
from kvrelay.quant import quantize_fp8_block, quantize_mxfp4, quantize_nvfp4
from kvrelay.weights.dsv4_names import is_fused_expert, model_expert_to_native, model_to_native

Layout = Literal["hf", "native", "nvfp4"]

# Stored FP8 in the native checkpoint (reference §6); e_proj/h_proj of the MTP block are an
# inference (the reference Linear defaults to FP8).
FP8_WEIGHT = re.compile(
    r"(?:layers|mtp)\.\d+\."
    r"(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|e_proj|h_proj)"
    r"\.weight"
)
# Stored F32 (reference §6): mHC parameters, sinks, compressor position biases, router bias.
F32_TENSOR = re.compile(r"(?:.*\.)?(?:hc_\w+|attn_sink|ape|gate\.bias)")
ROUTED_EXPERT = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")


def native_dtype(name: str) -> torch.dtype:
    """The dtype an unquantized native tensor is stored in."""
    if name.endswith("tid2eid"):
        return torch.int64
    return torch.float32 if F32_TENSOR.fullmatch(name) else torch.bfloat16


def native_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under native names, routed experts unfused (unquantized)."""
    out: dict[str, torch.Tensor] = {}
    e = model.config.n_routed_experts
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if not is_fused_expert(name):
            out[model_to_native(name)] = t
            continue
        for i in range(e):
            natives = model_expert_to_native(name, i)
            for part, piece in zip(natives, t[i].chunk(len(natives), dim=0), strict=True):
                out[part] = piece
    return out


def _encode_native(name: str, t: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    base = name[: -len("weight")]
    if ROUTED_EXPERT.fullmatch(name):
        if layout == "nvfp4" and name.startswith("layers."):
            q = quantize_nvfp4(t, input_scale=1.0)
            return {
                name: q.weight,
                base + "weight_scale": q.weight_scale,
                base + "weight_scale_2": q.weight_scale_2,
                base + "input_scale": q.input_scale,
            }
        packed, scale = quantize_mxfp4(t)
        return {name: packed, base + "scale": scale}
    if FP8_WEIGHT.fullmatch(name):
        q, scale = quantize_fp8_block(t)
        return {name: q, base + "scale": scale}
    return {name: t.to(native_dtype(name))}


def native_config_dict(c: DeepseekV4Config) -> dict[str, Any]:
    """`inference/config.json` for `c`, with DeepSeek-native keys."""
    ratios = [c.compress_ratio(i) for i in range(c.num_hidden_layers)]
    return {
        "vocab_size": c.vocab_size,
        "dim": c.hidden_size,
        "n_layers": c.num_hidden_layers,
        "n_heads": c.num_attention_heads,
        "head_dim": c.head_dim,
        "rope_head_dim": c.qk_rope_head_dim,
        "q_lora_rank": c.q_lora_rank,
        "o_groups": c.o_groups,
        "o_lora_rank": c.o_lora_rank,
        "compress_ratios": ratios + [0] * c.num_nextn_predict_layers,  # + the MTP slot
        "window_size": c.sliding_window,
        "index_n_heads": c.index_n_heads,
        "index_head_dim": c.index_head_dim,
        "index_topk": c.index_topk,
        "rope_theta": c.rope_theta,
        "compress_rope_theta": c.compress_rope_theta,
        "rope_factor": c.rope_factor,
        "original_seq_len": c.rope_original_max_position if c.rope_factor > 1 else 0,
        "beta_fast": c.rope_beta_fast,
        "beta_slow": c.rope_beta_slow,
        "max_seq_len": c.max_position_embeddings,
        "n_routed_experts": c.n_routed_experts,
        "n_shared_experts": c.n_shared_experts,
        "n_activated_experts": c.num_experts_per_tok,
        "moe_inter_dim": c.moe_intermediate_size,
        "n_hash_layers": sum(t == HASH_MOE for t in c.mlp_layer_types),
        "score_func": c.scoring_func,
        "route_scale": c.routed_scaling_factor,
        "swiglu_limit": c.swiglu_limit,
        "hc_mult": c.hc_mult,
        "hc_sinkhorn_iters": c.hc_sinkhorn_iters,
        "hc_eps": c.hc_eps,
        "norm_eps": c.rms_norm_eps,
        "n_mtp_layers": c.num_nextn_predict_layers,
        "dtype": "fp8",
        "expert_dtype": "fp4",
    }


_FP8_QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}


def _nvfp4_quant(c: DeepseekV4Config) -> dict[str, Any]:
    """The ModelOpt quantization_config reported for nvidia/DeepSeek-V4-Flash-NVFP4 (§7)."""
    layers = {
        f"layers.{i}.ffn.experts": {"quant_algo": "NVFP4", "group_size": 16}
        for i in range(c.num_hidden_layers)
    }
    return _FP8_QUANT | {
        "quant_algo": "MIXED_PRECISION",
        "moe_quant_algo": "NVFP4",
        "group_size": 16,
        "ignore": ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"],
        "quantized_layers": layers,
        "producer": {"name": "modelopt"},
    }


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))


def _write_json(path: str, d: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(d, f, indent=1)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str, shards: int = 1) -> None:
    """Write tensors in natural name order, split into `shards` files (with an index if > 1)."""
    names = sorted(tensors, key=_natural_key)
    if shards == 1:
        save_file(
            {n: tensors[n].contiguous() for n in names}, os.path.join(path, "model.safetensors")
        )
        return
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[s * per : (s + 1) * per]
        save_file({n: tensors[n].contiguous() for n in chunk}, os.path.join(path, file))
        weight_map |= dict.fromkeys(chunk, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(
        os.path.join(path, "model.safetensors.index.json"),
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


@torch.no_grad()
def save_dsv4_checkpoint(model: nn.Module, path: str, layout: Layout, shards: int = 1) -> None:
    """Write `model` (a `DeepseekV4ForCausalLM`) to directory `path` in `layout`."""
    c: DeepseekV4Config = model.config
    os.makedirs(path, exist_ok=True)
    if layout == "hf":
        tensors = {n: t.detach().cpu() for n, t in model.state_dict().items()}
        _write_json(os.path.join(path, "config.json"), c.to_hf_dict())
    elif layout in ("native", "nvfp4"):
        tensors = {}
        for name, t in native_tensors(model).items():
            tensors |= _encode_native(name, t, layout)
        if layout == "native":
            _write_json(os.path.join(path, "inference", "config.json"), native_config_dict(c))
        else:
            cfg = c.to_hf_dict() | {"quantization_config": _nvfp4_quant(c)}
            _write_json(os.path.join(path, "config.json"), cfg)
    else:
        raise ValueError(f"unknown layout {layout!r}; expected hf, native or nvfp4")
    save_safetensors(tensors, path, shards)
