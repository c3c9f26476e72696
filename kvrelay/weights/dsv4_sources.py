"""A DeepSeek-V4 checkpoint as lazy model tensors: model name -> `tensor_source.Source` of the
whole tensor, so a tensor-parallel rank can read just its slices (`dsv4_rank_load`).

Mirrors `Dsv4Checkpoint.tensors` (dequantized weights, native experts fused) and
`Dsv4Checkpoint.packed_experts` (raw FP4 bytes of the blocks the model keeps packed) without
reading anything: tensors are read only when a box of a source is.
"""

from __future__ import annotations

import torch

from kvrelay.quant import ExpertSlot
from kvrelay.weights.dsv4_checkpoint import HF, CheckpointError, Dsv4Checkpoint
from kvrelay.weights.tensor_source import (
    Cat,
    Dequantized,
    Reshaped,
    SafetensorsReader,
    Source,
    Stack,
    Stored,
)

_DEQUANT_ROLES = ("scale", "weight_scale", "weight_scale_2")  # input_scale: activations only


class Sources:
    def __init__(self, ckpt: Dsv4Checkpoint, reader: SafetensorsReader) -> None:
        self.ckpt, self.reader = ckpt, reader

    def stored(self, name: str) -> Stored:
        info = self.ckpt.index[name]
        return Stored(self.reader, info.file, info.stored, info.shape)

    def weight(self, name: str, dtype: torch.dtype) -> Source:
        """A stored weight, dequantized to `dtype` if it is quantized (else as stored)."""
        q = self.ckpt.quant(name)
        if q.fmt == "none":
            return self.stored(name)
        parts = {r: self.stored(c) for r, c in q.companions.items() if r in _DEQUANT_ROLES}
        return Dequantized(self.stored(name), q.fmt, parts, dtype, self.ckpt.weight_block)

    def dense(self, dtype: torch.dtype, skip: frozenset[str]) -> dict[str, Source]:
        """Every weight under its model name, as `Dsv4Checkpoint.tensors` yields them; modules
        named in `skip` (packed experts) left out."""
        out: dict[str, Source] = {}
        slots: dict[str, dict[tuple[int, int], Source]] = {}
        parts: dict[str, int] = {}
        for name in self.ckpt.weight_names():
            target = self.ckpt.model_target(name)
            if target is None:
                continue
            model_name = target.hf_name if isinstance(target, ExpertSlot) else target
            if model_name.rpartition(".")[0] in skip:
                continue
            if isinstance(target, ExpertSlot):
                slots.setdefault(model_name, {})[target.expert, target.part] = self.weight(
                    name, dtype
                )
                parts[model_name] = target.parts
            else:
                out[model_name] = self.weight(name, dtype)
        e = self.ckpt.config.n_routed_experts
        for model_name, got in slots.items():
            want = [(i, p) for i in range(e) for p in range(parts[model_name])]
            lost = [k for k in want if k not in got]
            if lost:
                raise CheckpointError(f"{model_name}: (expert, part) {lost[:4]} missing")
            out[model_name] = Stack(
                [Cat([got[i, p] for p in range(parts[model_name])], 0) for i in range(e)]
            )
        return out

    def packed(self, prefix: str) -> tuple[str, dict[str, Source]] | None:
        """(format, {PackedExperts field: raw source}) of block `prefix`'s routed experts
        ("layers.3", "mtp.0"), as `Dsv4Checkpoint.packed_experts` stacks them; None if the
        checkpoint has no such block."""
        if self.ckpt.naming == HF:
            return self._packed_hf(prefix)
        first = f"{prefix}.ffn.experts.0.w1.weight"
        if first not in self.ckpt.index:
            return None
        fmt = self.ckpt.quant(first).fmt
        if fmt not in ("mxfp4", "nvfp4"):
            raise CheckpointError(f"{prefix}: routed experts are {fmt}, not packed FP4")
        e = self.ckpt.config.n_routed_experts
        lost = [
            (i, proj)
            for i in range(e)
            for proj in ("w1", "w2", "w3")
            if f"{prefix}.ffn.experts.{i}.{proj}.weight" not in self.ckpt.index
        ]
        if lost:
            raise CheckpointError(
                f"{prefix}.ffn.experts: (expert, part) {lost[:4]} missing from the checkpoint"
            )

        def one(i: int, proj: str, role: str | None) -> Source:
            name = f"{prefix}.ffn.experts.{i}.{proj}.weight"
            src = self.stored(name if role is None else self.ckpt.quant(name).companions[role])
            return Reshaped(src, ()) if role in ("weight_scale_2", "input_scale") else src

        def gate_up(role: str | None) -> Source:
            pairs = [(one(i, "w1", role), one(i, "w3", role)) for i in range(e)]
            if role in ("weight_scale_2", "input_scale"):  # [E, 2]: gate's and up's scalar
                return Stack([Stack(p) for p in pairs])
            return Stack([Cat(p, 0) for p in pairs])

        def down(role: str | None) -> Source:
            return Stack([one(i, "w2", role) for i in range(e)])

        scale = "scale" if fmt == "mxfp4" else "weight_scale"
        out = {
            "gate_up": gate_up(None),
            "gate_up_scale": gate_up(scale),
            "down": down(None),
            "down_scale": down(scale),
        }
        if fmt == "nvfp4":
            out |= {
                "gate_up_scale_2": gate_up("weight_scale_2"),
                "down_scale_2": down("weight_scale_2"),
            }
        return fmt, out

    def _packed_hf(self, prefix: str) -> tuple[str, dict[str, Source]] | None:
        base = f"model.{prefix}.mlp.experts."
        gu, dn = base + "gate_up_proj", base + "down_proj"
        if gu not in self.ckpt.index:
            return None
        quants = self.ckpt.quant(gu), self.ckpt.quant(dn)
        if any(q.fmt != "mxfp4" for q in quants):
            raise CheckpointError(f"{prefix}: HF routed experts are not packed MXFP4")
        return "mxfp4", {
            "gate_up": self.stored(gu),
            "gate_up_scale": self.stored(quants[0].companions["scale"]),
            "down": self.stored(dn),
            "down_scale": self.stored(quants[1].companions["scale"]),
        }
