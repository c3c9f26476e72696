"""What a DeepSeek-V4 checkpoint directory holds: its config (HF-style `config.json` and/or
native `inference/config.json`) and how its tensors are encoded, read per tensor from its
companions and dtype (`quant_of`, `detect_format`). The registry's directory claim and config
reader live here; the tensors are read by `dsv4_checkpoint`, loaded by `dsv4_load`."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from kvrelay.models.deepseek_v4.config import DeepseekV4Config
from kvrelay.quant.encoding import Quant
from kvrelay.weights.dsv4_index import HF, SAVED, CheckpointError, TensorInfo, tensor_index
from kvrelay.weights.dsv4_names import is_native_name

ARCHITECTURE = "DeepseekV4ForCausalLM"
_NATIVE_V4_KEYS = ("compress_ratios", "hc_mult", "o_groups")
_PACKED_DTYPES = ("I8", "U8")
_NVFP4_LEAVES = ("weight_scale", "weight_scale_2", "input_scale")
PACKED_FORMATS = ("nvfp4", "mxfp4")  # routed experts the model keeps packed


# --- config ---------------------------------------------------------------------------------


def _is_dsv4_dict(d: dict[str, Any]) -> bool:
    if ARCHITECTURE in (d.get("architectures") or []) or d.get("model_type") == "deepseek_v4":
        return True
    native = "dim" in d or "n_layers" in d
    return native and any(k in d for k in _NATIVE_V4_KEYS)


def _load_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _config_dicts(path: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    return _load_json(os.path.join(path, "config.json")), _load_json(
        os.path.join(path, "inference", "config.json")
    )


def is_dsv4_dir(path: str) -> bool:
    """True if `path` holds a DeepSeek-V4 config (HF names, or native ones in config.json or
    inference/config.json)."""
    if not os.path.isdir(path):
        return False
    return any(d is not None and _is_dsv4_dict(d) for d in _config_dicts(path))


def read_dsv4_config(
    path: str, indexed: tuple[str, dict[str, TensorInfo]] | None = None
) -> tuple[DeepseekV4Config, dict[str, Any]]:
    """(config, raw config dict). The top-level config.json wins; inference/config.json (native
    names) is the fallback. The quantization_config, if any, comes from whichever has it.
    `indexed` (naming and tensor index, if the caller has read them) decides how experts are
    held and whether the QAT roundings are simulated."""
    root, native = _config_dicts(path)
    chosen = root if root is not None and _is_dsv4_dict(root) else native
    if chosen is None or not _is_dsv4_dict(chosen):
        raise CheckpointError(f"{path}: no DeepSeek-V4 config.json or inference/config.json")
    raw = dict(chosen)
    for d in (root, native):
        if d is not None and "quantization_config" in d and "quantization_config" not in raw:
            raw["quantization_config"] = d["quantization_config"]
    cfg = DeepseekV4Config.from_dict(raw)
    naming, index = tensor_index(path) if indexed is None else indexed
    if naming == SAVED and "qat_simulation" not in raw:
        # Written by transformers, whose DeepSeek-V4 forward does not simulate the reference's
        # FP8 KV / FP4 index roundings: that forward is what such weights were made and checked
        # with, so run as it does (a config.json may still ask for the simulation).
        cfg = cfg.with_(qat_simulation=False)
    # NVFP4 and MXFP4 experts stay packed in memory (how a Flash-sized model fits): the loader
    # copies their bytes into `Fp4Experts` / `Mxfp4Experts` instead of dequantizing them.
    fmt = detect_format(index, naming)
    if fmt.experts in PACKED_FORMATS:
        mtp = fmt.mtp_experts or fmt.experts
        cfg = cfg.with_(
            expert_format=fmt.experts,
            mtp_expert_format=mtp if mtp in PACKED_FORMATS else "dense",
        )
    return cfg, raw


def read_config(path: str) -> DeepseekV4Config:
    """The model config of a checkpoint directory (the registry's config reader)."""
    return read_dsv4_config(path)[0]


# --- per-tensor format ------------------------------------------------------------------------


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))


def _companion_candidates(name: str) -> dict[str, str]:
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # HF fused experts
        return {"scale": f"{name}_scale_inv"}
    if not name.endswith(".weight"):
        return {}
    base = name[: -len("weight")]
    if is_native_name(name):
        return {"scale": base + "scale"} | {leaf: base + leaf for leaf in _NVFP4_LEAVES}
    return {"scale": base + "weight_scale_inv"}


def quant_of(name: str, index: dict[str, TensorInfo]) -> Quant:
    """The encoding of weight `name`, read from which companions exist and the weight's dtype."""
    present = {k: v for k, v in _companion_candidates(name).items() if v in index}
    if "weight_scale_2" in present:
        nv = {k: present[k] for k in _NVFP4_LEAVES if k in present}
        if "weight_scale" not in nv:
            raise CheckpointError(f"{name}: NVFP4 weight without its weight_scale")
        return Quant("nvfp4", nv)
    if "scale" in present:
        dtype = index[name].dtype
        if dtype == "F8_E4M3":
            return Quant("fp8_block", {"scale": present["scale"]})
        if dtype in _PACKED_DTYPES:
            return Quant("mxfp4", {"scale": present["scale"]})
        raise CheckpointError(f"{name}: a scale beside a {dtype} weight is not a known format")
    return Quant("none", {})


@dataclass(frozen=True)
class CheckpointFormat:
    naming: str  # native | hf | transformers (save_pretrained)
    linears: str  # encoding of the attention projections: none | fp8_block
    experts: str  # encoding of the routed experts of layers.*: none | fp8_block | mxfp4 | nvfp4
    mtp_experts: str | None  # of the MTP block's routed experts; None without an MTP block

    def describe(self) -> str:
        return (
            f"naming={self.naming} linears={self.linears} experts={self.experts} "
            f"mtp_experts={self.mtp_experts}"
        )


def _first(index: dict[str, TensorInfo], pattern: str) -> str | None:
    rx = re.compile(pattern)
    hits = sorted((n for n in index if rx.fullmatch(n)), key=natural_key)
    return hits[0] if hits else None


# (attention projection, routed expert, MTP routed expert) name patterns of the index, whose
# save_pretrained entries are keyed by native names already.
_NATIVE_PATTERNS = (
    r"layers\.\d+\.attn\.wq_a\.weight",
    r"layers\.\d+\.ffn\.experts\.\d+\.w1\.weight",
    r"mtp\.\d+\.ffn\.experts\.\d+\.w1\.weight",
)
_HF_PATTERNS = (
    r"model\.layers\.\d+\.self_attn\.q_a_proj\.weight",
    r"model\.layers\.\d+\.mlp\.experts\.gate_up_proj",
    r"model\.mtp\.\d+\.mlp\.experts\.gate_up_proj",
)


def detect_format(index: dict[str, TensorInfo], naming: str) -> CheckpointFormat:
    """How the attention projections and routed experts are encoded (`index` as `tensor_index`
    returns it)."""
    patterns = _HF_PATTERNS if naming == HF else _NATIVE_PATTERNS
    fmts = []
    for pattern in patterns:
        name = _first(index, pattern)
        fmts.append(None if name is None else quant_of(name, index).fmt)
    for what, pattern, fmt in zip(
        ("attention projection", "routed expert"), patterns[:2], fmts[:2], strict=True
    ):
        if fmt is None:
            stored = pattern.replace("\\d+", "N").replace("\\", "")
            if naming == SAVED:
                stored = "model." + stored
            raise CheckpointError(
                f"no {what} tensors found: a {naming}-named DeepSeek-V4 checkpoint has "
                f"{stored} (unsupported layout, or not a DeepSeek-V4 checkpoint)"
            )
    return CheckpointFormat(naming, fmts[0], fmts[1], fmts[2])
