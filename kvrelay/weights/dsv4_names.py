"""DeepSeek-V4 checkpoint names -> kvrelay model names, MTP block included.

kvrelay's `DeepseekV4ForCausalLM` uses HF-transformers names (`kvrelay.quant.names` maps them),
and keeps the MTP block, which HF does not have, at `model.mtp.K.*`. The native MTP block
(`mtp.K.*`, reference §5, §6) is a decoder block (same names as `layers.N.*`) plus its own
input norms/projections and hyper head; this module maps those too, in both directions.
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
