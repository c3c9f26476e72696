"""DeepSeek-V4 tensor names: DeepSeek-native <-> HF transformers, and where the scales live.

Sources:
- Native names and which tensors carry scales: shared/reference/deepseek-v4.md §6 (original
  checkpoint) and §7 (NVFP4 checkpoint, which keeps native names).
- HF names: the rename map the reference cites, ``transformers/conversion_mapping.py`` entry
  "deepseek_v4" in transformers 5.24.0, plus ``quantizer_finegrained_fp8.py``, which renames a
  checkpoint's ``X.scale`` to ``X.weight_scale_inv``. HF state-dict keys carry the ``model.``
  prefix except ``lm_head.weight`` (``base_model_prefix = "model"``). ``tests/quant/test_names.py``
  checks this module against that installed code and against the HF model's own parameters.

Facts the sources do not give, left unmapped on purpose:
- HF has no MTP module and ignores ``mtp.*`` keys (``_keys_to_ignore_on_load_unexpected``), so
  ``mtp.*`` names have no HF name.
- HF transformers 5.24 has no NVFP4 (ModelOpt) path for DeepSeek-V4, so ``.weight_scale``,
  ``.weight_scale_2`` and ``.input_scale`` have no HF name.

HF fuses the routed experts: native ``layers.N.ffn.experts.E.w1/w3.weight`` ([I, K] each) are
stacked and concatenated into ``model.layers.N.mlp.experts.gate_up_proj`` [n_experts, 2I, K]
(w1 = gate first, then w3 = up); ``w2`` becomes ``experts.down_proj`` [n_experts, K_out, I]. Their
``.scale`` tensors fuse the same way into ``gate_up_proj_scale_inv`` / ``down_proj_scale_inv``.
:func:`native_to_hf` returns the fused name; :func:`expert_slot` says where inside it a native
tensor goes, and :func:`hf_expert_to_native` goes back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

QuantFormat = Literal["fp8_block", "mxfp4", "nvfp4", "hf"]


class UnmappedNameError(KeyError):
    """A tensor name the mapping does not know, or one with no counterpart in the other naming."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


# Top-level tensors (no layer index).
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

# Modules under layers.N whose tensors are `.weight` (+ `.scale` for the FP8 ones).
_LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.q_norm": "self_attn.q_a_norm",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj",
    "attn.kv_norm": "self_attn.kv_norm",
    "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "attn.compressor.wkv": "self_attn.compressor.kv_proj",
    "attn.compressor.wgate": "self_attn.compressor.gate_proj",
    "attn.compressor.norm": "self_attn.compressor.kv_norm",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
    "attn.indexer.weights_proj": "self_attn.compressor.indexer.scorer.weights_proj",
    "attn.indexer.compressor.wkv": "self_attn.compressor.indexer.kv_proj",
    "attn.indexer.compressor.wgate": "self_attn.compressor.indexer.gate_proj",
    "attn.indexer.compressor.norm": "self_attn.compressor.indexer.kv_norm",
    "ffn.gate": "mlp.gate",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
}

# Bare parameters under layers.N (not `.weight` of a module).
_LAYER_PARAMS = {
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
}

# Native leaf -> HF leaf for module tensors.
_LEAVES = {"weight": "weight", "scale": "weight_scale_inv"}
_NVFP4_LEAVES = ("weight_scale", "weight_scale_2", "input_scale")

# Routed experts: native projection -> (HF fused tensor, position in the dim-1 concat, parts).
_EXPERT_PROJ = {
    "w1": ("gate_up_proj", 0, 2),
    "w3": ("gate_up_proj", 1, 2),
    "w2": ("down_proj", 0, 1),
}
_HF_EXPERT_PARTS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}

_TOP_INV = {v: k for k, v in _TOP.items()}
_LAYER_MODULES_INV = {v: k for k, v in _LAYER_MODULES.items()}
_LAYER_PARAMS_INV = {v: k for k, v in _LAYER_PARAMS.items()}
_LEAVES_INV = {v: k for k, v in _LEAVES.items()}

_NATIVE_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_NATIVE_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.(\w+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv)?")


@dataclass(frozen=True)
class ExpertSlot:
    """Where a native routed-expert tensor sits inside HF's fused expert tensor.

    HF tensor ``hf_name`` has shape [n_experts, parts * R, C] for a native [R, C] tensor; this one
    is ``hf[expert, part * R:(part + 1) * R]``.
    """

    hf_name: str
    expert: int
    part: int
    parts: int


def _split_leaf(rel: str) -> tuple[str, str]:
    module, _, leaf = rel.rpartition(".")
    return module, leaf


def expert_slot(native_name: str) -> ExpertSlot | None:
    """The fused HF location of a native routed-expert weight/scale; None for other names."""
    m = _NATIVE_LAYER.fullmatch(native_name)
    e = _NATIVE_EXPERT.fullmatch(m.group(2)) if m else None
    if e is None:
        return None
    assert m is not None
    layer, (expert, proj, leaf) = m.group(1), e.groups()
    if leaf in _NVFP4_LEAVES:
        raise UnmappedNameError(f"{native_name}: HF transformers 5.24 has no NVFP4 expert tensors")
    if leaf not in _LEAVES:
        raise UnmappedNameError(f"{native_name}: unknown expert tensor suffix {leaf!r}")
    fused, part, parts = _EXPERT_PROJ[proj]
    suffix = "_scale_inv" if leaf == "scale" else ""
    return ExpertSlot(f"model.layers.{layer}.mlp.experts.{fused}{suffix}", int(expert), part, parts)


def native_to_hf(name: str) -> str:
    """DeepSeek-native tensor name -> HF transformers state-dict key.

    Routed experts map to the fused HF tensor (see :func:`expert_slot` for the slice).
    Raises :class:`UnmappedNameError` for names without an HF counterpart (mtp.*, NVFP4 scales)
    or unknown names.
    """
    if name in _TOP:
        return _TOP[name]
    if name.startswith("mtp."):
        raise UnmappedNameError(f"{name}: HF transformers has no MTP module (it ignores mtp.*)")
    m = _NATIVE_LAYER.fullmatch(name)
    if m is None:
        raise UnmappedNameError(f"{name}: not a known DeepSeek-V4 tensor name")
    layer, rel = m.groups()
    slot = expert_slot(name)
    if slot is not None:
        return slot.hf_name
    if rel in _LAYER_PARAMS:
        return f"model.layers.{layer}.{_LAYER_PARAMS[rel]}"
    module, leaf = _split_leaf(rel)
    if module in _LAYER_MODULES and leaf in _LEAVES:
        return f"model.layers.{layer}.{_LAYER_MODULES[module]}.{_LEAVES[leaf]}"
    if leaf in _NVFP4_LEAVES:
        raise UnmappedNameError(f"{name}: HF transformers 5.24 has no NVFP4 tensors")
    raise UnmappedNameError(f"{name}: not a known DeepSeek-V4 tensor name")


def hf_to_native(name: str) -> str:
    """HF transformers state-dict key -> DeepSeek-native name (inverse of :func:`native_to_hf`).

    The fused expert tensors hold many native tensors: use :func:`hf_expert_to_native` for them.
    """
    if name in _TOP_INV:
        return _TOP_INV[name]
    m = _HF_LAYER.fullmatch(name)
    if m is None:
        raise UnmappedNameError(f"{name}: not a known HF DeepSeek-V4 tensor name")
    layer, rel = m.groups()
    if _HF_EXPERT.fullmatch(rel):
        raise UnmappedNameError(f"{name}: fused expert tensor, use hf_expert_to_native()")
    if rel in _LAYER_PARAMS_INV:
        return f"layers.{layer}.{_LAYER_PARAMS_INV[rel]}"
    module, leaf = _split_leaf(rel)
    if module in _LAYER_MODULES_INV and leaf in _LEAVES_INV:
        return f"layers.{layer}.{_LAYER_MODULES_INV[module]}.{_LEAVES_INV[leaf]}"
    raise UnmappedNameError(f"{name}: not a known HF DeepSeek-V4 tensor name")


def hf_expert_to_native(name: str, expert: int) -> tuple[str, ...]:
    """Native names making up ``expert``'s slice of a fused HF expert tensor, in concat order.

    ``model.layers.3.mlp.experts.gate_up_proj``, 5 -> (``layers.3.ffn.experts.5.w1.weight``,
    ``layers.3.ffn.experts.5.w3.weight``).
    """
    m = _HF_LAYER.fullmatch(name)
    e = _HF_EXPERT.fullmatch(m.group(2)) if m else None
    if e is None:
        raise UnmappedNameError(f"{name}: not a fused HF expert tensor")
    assert m is not None
    fused, scale = e.groups()
    leaf = "scale" if scale else "weight"
    prefix = f"layers.{m.group(1)}.ffn.experts.{expert}"
    return tuple(f"{prefix}.{proj}.{leaf}" for proj in _HF_EXPERT_PARTS[fused])


def scale_names_for(weight_name: str, fmt: QuantFormat) -> dict[str, str]:
    """All quantization companions of a weight, by role.

    - ``fp8_block`` / ``mxfp4`` (native, §6): {"scale": "X.scale"}.
    - ``nvfp4`` (§7): {"weight_scale": "X.weight_scale", "weight_scale_2": "X.weight_scale_2",
      "input_scale": "X.input_scale"}.
    - ``hf``: {"scale": "X.weight_scale_inv"}; for the fused experts ``..._scale_inv``.
    """
    if fmt == "hf":
        m = _HF_LAYER.fullmatch(weight_name)
        e = _HF_EXPERT.fullmatch(m.group(2)) if m else None
        if e is not None and e.group(2) is None:
            return {"scale": f"{weight_name}_scale_inv"}
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name!r} is not a weight name (expected '<module>.weight')")
    base = weight_name[: -len(".weight")]
    if fmt in ("fp8_block", "mxfp4"):
        return {"scale": f"{base}.scale"}
    if fmt == "nvfp4":
        return {leaf: f"{base}.{leaf}" for leaf in _NVFP4_LEAVES}
    if fmt == "hf":
        return {"scale": f"{base}.weight_scale_inv"}
    raise ValueError(f"unknown format {fmt!r}; expected fp8_block, mxfp4, nvfp4 or hf")


def scale_name_for(weight_name: str, fmt: QuantFormat) -> str:
    """The per-block scale tensor of a weight: ``X.scale`` (fp8_block, mxfp4), ``X.weight_scale``
    (nvfp4) or ``X.weight_scale_inv`` (hf)."""
    names = scale_names_for(weight_name, fmt)
    return names["weight_scale"] if fmt == "nvfp4" else names["scale"]


def weight_name_for_scale(name: str) -> str | None:
    """The weight a quantization-companion tensor belongs to, or None if ``name`` is not one.

    Knows ``.scale`` (native), ``.weight_scale_inv`` / ``*_proj_scale_inv`` (HF),
    ``.weight_scale``, ``.weight_scale_2``, ``.input_scale`` (NVFP4). HF's mHC parameters
    ``attn_hc.scale`` / ``ffn_hc.scale`` and native ``hc_*_scale`` are not quantization scales.
    """
    for leaf in ("weight_scale_inv", *_NVFP4_LEAVES):
        if name.endswith(f".{leaf}"):
            return name[: -len(leaf)] + "weight"
    m = _HF_LAYER.fullmatch(name)
    e = _HF_EXPERT.fullmatch(m.group(2)) if m else None
    if e is not None and e.group(2):
        return name[: -len("_scale_inv")]
    if name.endswith(".scale") and not name.endswith(("attn_hc.scale", "ffn_hc.scale")):
        return name[: -len("scale")] + "weight"
    return None
