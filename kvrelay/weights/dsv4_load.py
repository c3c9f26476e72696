"""Load a DeepSeek-V4 checkpoint into the model: every tensor copied as it is read (strict:
unknown names, wrong shapes and missing tensors raise), NVFP4 / MXFP4 routed experts copied as
their packed bytes into the modules that keep them packed."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from kvrelay.weights.dsv4_checkpoint import Dsv4Checkpoint
from kvrelay.weights.dsv4_index import CheckpointError

log = logging.getLogger("kvrelay.weights")


def load_checkpoint(model: nn.Module, ckpt: Dsv4Checkpoint) -> None:
    """Copy every checkpoint tensor into `model` (a `DeepseekV4ForCausalLM`) as it is read.

    Strict like `load_hf_state_dict`: unknown names, wrong shapes and missing tensors raise,
    except an entirely absent MTP block (it stays as initialised) and a tied `lm_head`.
    """
    t0 = time.perf_counter()
    own = model.state_dict()
    dtype = model.lm_head.weight.dtype
    device = model.lm_head.weight.device
    seen = _load_packed_experts(model, ckpt, own)
    skip = frozenset(n.rpartition(".")[0] for n in seen)
    for name, t in ckpt.tensors(dtype, device, skip=skip):
        dst = own.get(name)
        if dst is None:
            raise CheckpointError(f"{name}: the model has no such parameter")
        if dst.shape != t.shape:
            raise CheckpointError(
                f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(dst.shape)}"
            )
        dst.copy_(t)
        seen.add(name)
    missing = set(own) - seen
    if getattr(model.config, "tie_word_embeddings", False):
        missing.discard("lm_head.weight")
    mtp = {k for k in own if k.startswith("model.mtp.")}
    if missing and missing == mtp:
        log.info("checkpoint has no MTP block; it stays as initialised tensors=%d", len(mtp))
        missing = set()
    if missing:
        raise CheckpointError(f"tensors missing from the checkpoint: {sorted(missing)[:8]}")
    log.info(
        "checkpoint loaded path=%s %s tensors=%d packed_expert_blocks=%d dtype=%s device=%s "
        "seconds=%.2f",
        ckpt.path, ckpt.format.describe(), len(seen), len(skip), dtype, device,
        time.perf_counter() - t0,
    )  # fmt: skip


# per format: expert module buffer -> the PackedExperts field it is copied from
PACKED_FIELDS = {
    "nvfp4": {
        "gate_up_packed": "gate_up",
        "gate_up_scale": "gate_up_scale",
        "gate_up_scale_2": "gate_up_scale_2",
        "down_packed": "down",
        "down_scale": "down_scale",
        "down_scale_2": "down_scale_2",
    },
    "mxfp4": {
        "gate_up_packed": "gate_up",
        "gate_up_scale": "gate_up_scale",
        "down_packed": "down",
        "down_scale": "down_scale",
    },
}


def _load_packed_experts(model: nn.Module, ckpt: Dsv4Checkpoint, own: dict) -> set[str]:
    """Copy the stored NVFP4 / MXFP4 bytes of every block whose experts the model keeps packed
    (`Fp4Experts`, `Mxfp4Experts`); returns the state-dict names filled."""
    from kvrelay.models.deepseek_v4.experts import QuantizedExperts

    filled: set[str] = set()
    for path, module in model.named_modules():
        if not isinstance(module, QuantizedExperts):
            continue
        kind, n = path.removeprefix("model.").split(".")[:2]  # layers.3.mlp.experts
        block: int | str = int(n) if kind == "layers" else f"mtp.{n}"
        try:
            packed = ckpt.packed_experts(block)
        except KeyError:
            if kind == "mtp":
                continue  # an absent MTP block stays as initialised
            raise
        if packed.fmt != module.fp4_format:
            raise CheckpointError(
                f"{path}: the checkpoint's experts are {packed.fmt}; the model holds "
                f"{module.fp4_format}"
            )
        for buf, field in PACKED_FIELDS[packed.fmt].items():
            name, t = f"{path}.{buf}", getattr(packed, field)
            if t.dtype == torch.float8_e8m0fnu:  # MXFP4 scales: the module keeps raw bytes
                t = t.view(torch.uint8)
            if own[name].shape != t.shape or own[name].dtype != t.dtype:
                raise CheckpointError(
                    f"{name}: checkpoint {t.dtype} {tuple(t.shape)} != model "
                    f"{own[name].dtype} {tuple(own[name].shape)}"
                )
            own[name].copy_(t)
            filled.add(name)
    return filled


def load_mtp_block(model: nn.Module, path: str) -> None:
    """Copy an MTP block saved on its own (a safetensors file of exactly the model's
    `model.mtp.*` tensors, e.g. one trained for a checkpoint that has none) into `model`.
    Strict: a missing, unknown or misshapen tensor raises."""
    from safetensors.torch import load_file

    own = {k: v for k, v in model.state_dict().items() if k.startswith("model.mtp.")}
    got = load_file(path)
    if set(got) != set(own):
        extra, missing = sorted(set(got) - set(own)), sorted(set(own) - set(got))
        raise CheckpointError(f"{path}: not this model's MTP block (extra {extra[:4]}, "
                              f"missing {missing[:4]})")  # fmt: skip
    for name, t in got.items():
        if t.shape != own[name].shape:
            raise CheckpointError(f"{name}: shape {tuple(t.shape)} != {tuple(own[name].shape)}")
        own[name].copy_(t)
    log.info("MTP block loaded path=%s tensors=%d", path, len(got))
