"""DeepSeek-V4 checkpoint names -> kvrelay model names, MTP block included.

kvrelay's `DeepseekV4ForCausalLM` uses HF-transformers names (`kvrelay.quant.names` maps them),
and keeps the MTP block, which HF does not have, at `model.mtp.K.*`. The native MTP block
(`mtp.K.*`, reference §5, §6) is a decoder block (same names as `layers.N.*`) plus its own
input norms/projections and hyper head; this module maps those too, in both directions.

A third naming is what transformers' `save_pretrained` writes (5.24): it undoes its load-time
renames (conversion_mapping.py, "deepseek_v4"), so per-layer tensors come back under their
native names below `model.layers.N.` (`attn.wq_a`, `ffn.experts.E.w1`, `hc_attn_fn`, ...).
Three tensors differ from native: the rules for embed/head/hc_head are anchored at the start of
the name, which the `model.` prefix defeats for all but `head.weight`, so embeddings, final
norm and hyper head keep their model names; and the load rule `.norm.` -> `.kv_norm.` undone
turns the attention's `attn.kv_norm` into `attn.norm`. `saved_to_native` maps them back.
"""

from __future__ import annotations

import re

from kvrelay.quant.names import (
    ExpertSlot,
    UnmappedNameError,
    expert_slot,
    hf_expert_to_native,
    hf_to_native,
    native_to_hf,
)

# MTP-only tensors (native -> model name relative to the block); [C] in reference §4-§5.
_MTP_OWN = {
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
}
_MTP_OWN_INV = {v: k for k, v in _MTP_OWN.items()}
_NATIVE_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_MODEL_MTP = re.compile(r"model\.mtp\.(\d+)\.(.+)")
# A stand-in layer index for mapping an MTP block's names through the decoder-layer mapping.
_PROBE = "layers.0."
_MODEL_PROBE = "model.layers.0."


# transformers' save_pretrained: top-level tensors -> native names.
_SAVED_TOP = {
    "head.weight": "head.weight",
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
_SAVED_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Attention/FFN tensors under native module names below `model.layers.N.` mark a save_pretrained
# checkpoint (the HF-converted naming has `self_attn.` / `mlp.` there).
SAVED_LAYER_PREFIX = re.compile(r"model\.layers\.\d+\.(attn|ffn)\.")


def saved_to_native(name: str) -> str:
    """A tensor name written by transformers' save_pretrained -> the DeepSeek-native name.

    Raises `UnmappedNameError` for names outside `model.layers.N.*` and the six top-level
    tensors (transformers saves no MTP block); whether the native name is a known tensor is
    checked where it is mapped to the model (`native_to_model`).
    """
    if name in _SAVED_TOP:
        return _SAVED_TOP[name]
    m = _SAVED_LAYER.fullmatch(name)
    if m is None:
        raise UnmappedNameError(f"{name}: not a tensor name of transformers' DeepSeek-V4 save")
    layer, rel = m.groups()
    if rel.startswith("attn.norm."):  # attn.kv_norm, renamed by undoing `.norm.` -> `.kv_norm.`
        rel = "attn.kv_norm." + rel[len("attn.norm.") :]
    return f"layers.{layer}.{rel}"


def is_native_name(name: str) -> bool:
    """True for DeepSeek-native names, False for HF/kvrelay names (`model.*`, `lm_head.*`)."""
    return not (name.startswith("model.") or name.startswith("lm_head."))


def native_to_model(name: str) -> str | ExpertSlot:
    """A native tensor name -> the model's parameter name, or the slot of a routed expert's
    slice inside the fused `experts.gate_up_proj` / `experts.down_proj` (and `_scale_inv`).

    Raises `UnmappedNameError` for unknown names (NVFP4 companions are handled by the reader).
    """
    m = _NATIVE_MTP.fullmatch(name)
    if m is None:
        slot = expert_slot(name)
        return slot if slot is not None else native_to_hf(name)
    block, rel = m.groups()
    prefix = f"model.mtp.{block}."
    if rel in _MTP_OWN:
        return prefix + _MTP_OWN[rel]
    slot = expert_slot(_PROBE + rel)
    if slot is not None:
        hf = prefix + slot.hf_name[len(_MODEL_PROBE) :]
        return ExpertSlot(hf, slot.expert, slot.part, slot.parts)
    try:
        return prefix + native_to_hf(_PROBE + rel)[len(_MODEL_PROBE) :]
    except UnmappedNameError:
        raise UnmappedNameError(f"{name}: not a known DeepSeek-V4 MTP tensor name") from None


def model_to_native(name: str) -> str:
    """Inverse of `native_to_model` for every non-fused model name (mtp included)."""
    m = _MODEL_MTP.fullmatch(name)
    if m is None:
        return hf_to_native(name)
    block, rel = m.groups()
    if rel in _MTP_OWN_INV:
        return f"mtp.{block}.{_MTP_OWN_INV[rel]}"
    return f"mtp.{block}." + hf_to_native(_MODEL_PROBE + rel)[len(_PROBE) :]


def model_expert_to_native(name: str, expert: int) -> tuple[str, ...]:
    """Native names of `expert`'s slice of a fused model expert tensor, in concat order."""
    m = _MODEL_MTP.fullmatch(name)
    if m is None:
        return hf_expert_to_native(name, expert)
    block, rel = m.groups()
    natives = hf_expert_to_native(_MODEL_PROBE + rel, expert)
    return tuple(f"mtp.{block}." + n[len(_PROBE) :] for n in natives)


def is_fused_expert(model_name: str) -> bool:
    return model_name.endswith(("experts.gate_up_proj", "experts.down_proj"))
