"""DeepSeek-V4 checkpoint tensors: stream them dequantized under the model's (HF) names, and
hand out the packed routed experts. (The config and per-tensor encodings are read by
`dsv4_config`; `dsv4_load` copies the tensors into a model.)

Layouts (shared/reference/deepseek-v4.md §6, §7; quant formats in `kvrelay.quant`):
- DeepSeek native: `embed.weight`, `layers.N.attn.wq_a.weight` + `.scale` (FP8 e4m3, ue8m0 per
  128x128), routed experts `layers.N.ffn.experts.E.w1.weight` I8 packed e2m1 + `.scale` ue8m0
  per 32 (MXFP4), `mtp.0.*` for the MTP block. Config: HF-style `config.json` and/or
  `inference/config.json` with native keys (dim, n_layers, ...).
- NVIDIA NVFP4: native names; routed experts of `layers.*` are U8 packed e2m1 +
  `.weight_scale` (e4m3 per 16) + `.weight_scale_2` + `.input_scale` (fp32 scalars).
- HF transformers: `model.layers.N.self_attn.q_a_proj.weight`, fused `mlp.experts.gate_up_proj`;
  unquantized, or FP8 with `.weight_scale_inv` (and fused `gate_up_proj_scale_inv`).
- transformers' save_pretrained: native per-layer names under `model.layers.N.` (`attn.wq_a`,
  `ffn.experts.E.w1`, `hc_attn_fn`), with `model.embed_tokens.weight` and `head.weight`
  (`dsv4_names.saved_to_native`); read as a native checkpoint once re-keyed (`dsv4_index`).
  Its config.json is transformers' own (layer_types, mlp_layer_types, compress_rates, ...).

The format is read per tensor from its companions and dtype, so mixed layouts (FP8 linears,
NVFP4 layer experts, MXFP4 MTP experts) need no switch. Tensors are read and dequantized one at
a time; native per-expert tensors go straight into one preallocated stack per fused tensor,
which is yielded as soon as its last expert arrives.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvrelay.quant import (
    DEFAULT_WEIGHT_BLOCK,
    ExpertSlot,
    UnmappedNameError,
    dequantize_mxfp4,
    dequantize_nvfp4,
)
from kvrelay.quant.encoding import Quant, dequantize
from kvrelay.weights import hf_dir
from kvrelay.weights.dsv4_config import detect_format, natural_key, quant_of, read_dsv4_config
from kvrelay.weights.dsv4_index import HF, CheckpointError, tensor_index
from kvrelay.weights.dsv4_names import native_to_model
from kvrelay.weights.dsv4_shard import shard

__all__ = ["CheckpointError", "Dsv4Checkpoint", "PackedExperts", "Quant", "dequantize"]

log = logging.getLogger("kvrelay.weights")


# --- packed routed experts --------------------------------------------------------------------


@dataclass
class PackedExperts:
    """One layer's routed experts as stored (for FP4 GEMM kernels), stacked over experts.

    gate_up rows are w1 (gate) then w3 (up), like the model's `experts.gate_up_proj`.
    mxfp4: scales are float8_e8m0fnu per 32 inputs. nvfp4: scales are float8_e4m3fn per 16,
    `*_scale_2` the fp32 global scales ([E, 2] for w1/w3, [E] for w2), `*_input_scale` likewise.
    """

    fmt: str  # mxfp4 | nvfp4
    gate_up: torch.Tensor  # uint8 [E, 2I, hidden/2]
    gate_up_scale: torch.Tensor  # [E, 2I, hidden/block]
    down: torch.Tensor  # uint8 [E, hidden, I/2]
    down_scale: torch.Tensor  # [E, hidden, I/block]
    gate_up_scale_2: torch.Tensor | None = None
    down_scale_2: torch.Tensor | None = None
    gate_up_input_scale: torch.Tensor | None = None
    down_input_scale: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, hidden], down [E, hidden, I]) in `dtype`."""
        if self.fmt == "mxfp4":
            return (
                dequantize_mxfp4(self.gate_up, self.gate_up_scale, dtype),
                dequantize_mxfp4(self.down, self.down_scale, dtype),
            )
        assert self.gate_up_scale_2 is not None and self.down_scale_2 is not None
        e = self.gate_up.shape[0]
        halves = (e, 2, self.gate_up.shape[1] // 2)  # w1 and w3 carry their own global scale
        gate_up = dequantize_nvfp4(
            self.gate_up.reshape(*halves, -1),
            self.gate_up_scale.reshape(*halves, -1),
            self.gate_up_scale_2,
            dtype,
        ).flatten(1, 2)
        return gate_up, dequantize_nvfp4(self.down, self.down_scale, self.down_scale_2, dtype)


# --- the reader -------------------------------------------------------------------------------


class _ExpertStack:
    """A fused expert tensor [E, parts*R, C] filled slice by slice."""

    def __init__(self, name: str, n_experts: int, slot: ExpertSlot, first: torch.Tensor) -> None:
        self.name, self.parts = name, slot.parts
        rows, cols = first.shape
        self.tensor = first.new_empty(n_experts, slot.parts * rows, cols)
        self.missing = {(e, p) for e in range(n_experts) for p in range(slot.parts)}

    def put(self, slot: ExpertSlot, t: torch.Tensor) -> bool:
        """Store one slice; True once every slice is in."""
        if (slot.expert, slot.part) not in self.missing:
            raise CheckpointError(f"{self.name}: expert {slot.expert} part {slot.part} repeated")
        rows = self.tensor.shape[1] // self.parts
        if t.shape != (rows, self.tensor.shape[2]):
            raise CheckpointError(f"{self.name}: expert {slot.expert} has shape {tuple(t.shape)}")
        self.tensor[slot.expert, slot.part * rows : (slot.part + 1) * rows] = t
        self.missing.discard((slot.expert, slot.part))
        return not self.missing


class Dsv4Checkpoint:
    """A DeepSeek-V4 checkpoint directory, opened lazily (headers only until tensors are read).

    Use as a context manager, or call `close()`, to release the memory-mapped files.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.naming, self.index = tensor_index(path)
        self.config, self.raw_config = read_dsv4_config(path, (self.naming, self.index))
        self.format = detect_format(self.index, self.naming)
        q = self.raw_config.get("quantization_config") or {}
        self.weight_block = tuple(q.get("weight_block_size") or DEFAULT_WEIGHT_BLOCK)
        self._quants = {n: quant_of(n, self.index) for n in self.index}
        self._companions = {c for q in self._quants.values() for c in q.companions.values()}
        self._files: dict[str, Any] = {}

    def __enter__(self) -> Dsv4Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._files.clear()

    def get(self, name: str) -> torch.Tensor:
        """One stored tensor, as stored."""
        from safetensors import safe_open

        info = self.index.get(name)
        if info is None:
            raise KeyError(f"{name} is not in the checkpoint {self.path}")
        if info.file not in self._files:
            self._files[info.file] = safe_open(info.file, framework="pt")
        return self._files[info.file].get_tensor(info.stored)

    def quant(self, name: str) -> Quant:
        """How the stored weight `name` is encoded, and its companions."""
        return self._quants[name]

    def weight_names(self) -> list[str]:
        """Every stored tensor except quantization companions, file by file in natural order
        (so one layer's experts arrive together)."""
        order = {f: i for i, f in enumerate(hf_dir.safetensors_files(self.path))}
        names = [n for n in self.index if n not in self._companions]
        return sorted(names, key=lambda n: (order[self.index[n].file], natural_key(n)))

    def read_dequantized(
        self, name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """A stored weight dequantized on `device` (packed bytes move, not the dense result)."""
        quant = self._quants[name]
        parts = {role: self.get(c).to(device) for role, c in quant.companions.items()}
        return dequantize(self.get(name).to(device), quant, parts, dtype, self.weight_block)

    def tensors(
        self,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: tuple[int, int] | None = None,
        skip: frozenset[str] = frozenset(),
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(model name, tensor) for every weight: quantized ones dequantized to `dtype`, others
        as stored; native routed experts fused into `experts.gate_up_proj` / `down_proj`.

        tp = (rank, world) yields only that rank's part (rules in `dsv4_shard`) of whole tensors
        read and dequantized (`dsv4_rank_load` reads only a rank's slices). Unknown
        `mtp.*` names are skipped with a warning (the MTP block is optional); any other unknown
        name raises `CheckpointError`. Tensors of the modules named in `skip` (e.g.
        "model.layers.3.mlp.experts", loaded packed instead) are not read at all.
        """
        stacks: dict[str, _ExpertStack] = {}
        n_experts = self.config.n_routed_experts
        for name in self.weight_names():
            target = self.model_target(name)
            if target is None:
                continue
            model_name = target.hf_name if isinstance(target, ExpertSlot) else target
            if model_name.rpartition(".")[0] in skip:
                continue
            t = self.read_dequantized(name, dtype, device)
            if isinstance(target, ExpertSlot):
                stack = stacks.get(target.hf_name)
                if stack is None:
                    stack = stacks[target.hf_name] = _ExpertStack(
                        target.hf_name, n_experts, target, t
                    )
                if not stack.put(target, t):
                    continue
                del stacks[target.hf_name]
                out_name, t = target.hf_name, stack.tensor
            else:
                out_name = target
            yield out_name, (t if tp is None else shard(out_name, t, *tp))
        if stacks:
            name, stack = next(iter(stacks.items()))
            lost = sorted(stack.missing)[:4]
            raise CheckpointError(f"{name}: (expert, part) {lost} missing from the checkpoint")

    def model_target(self, name: str) -> str | ExpertSlot | None:
        """The model tensor that stored weight `name` fills (a slot of a fused expert tensor for
        native per-expert weights); None for an unknown `mtp.*` name (skipped with a warning:
        the MTP block is optional). Any other unknown name raises `CheckpointError`."""
        try:
            return name if self.naming == HF else native_to_model(name)
        except UnmappedNameError as exc:
            if name.startswith("mtp."):
                log.warning("checkpoint tensor skipped name=%s reason=%s", name, exc)
                return None
            stored = self.index[name].stored
            raise CheckpointError(
                str(exc) if stored == name else f"{stored} (read as {name}): {exc}"
            ) from None

    def packed_experts(self, block: int | str) -> PackedExperts:
        """Layer `block`'s routed experts in their stored FP4 form; `block` is a layer index or
        an MTP block prefix such as "mtp.0"."""
        prefix = f"layers.{block}" if isinstance(block, int) else block
        if self.naming == HF:
            return self._packed_hf(prefix)
        e = self.config.n_routed_experts
        first = f"{prefix}.ffn.experts.0.w1.weight"
        if first not in self.index:
            raise KeyError(f"{first} is not in the checkpoint")
        fmt = self._quants[first].fmt
        if fmt not in ("mxfp4", "nvfp4"):
            raise CheckpointError(f"{prefix}: routed experts are {fmt}, not packed FP4")

        lost = [
            (i, proj)
            for i in range(e)
            for proj in ("w1", "w2", "w3")
            if f"{prefix}.ffn.experts.{i}.{proj}.weight" not in self.index
        ]
        if lost:
            raise CheckpointError(
                f"{prefix}.ffn.experts: (expert, part) {lost[:4]} missing from the checkpoint"
            )

        def stacked(proj: str, role: str | None) -> torch.Tensor:
            names = [f"{prefix}.ffn.experts.{i}.{proj}.weight" for i in range(e)]
            if role is not None:
                names = [self._quants[n].companions[role] for n in names]
            t = torch.stack([self.get(n) for n in names])
            return t.view(torch.uint8) if t.dtype == torch.int8 else t

        def gate_up(role: str | None) -> torch.Tensor:
            w1, w3 = stacked("w1", role), stacked("w3", role)
            if role in ("weight_scale_2", "input_scale"):  # one scalar per expert and matrix
                return torch.stack([w1.reshape(e), w3.reshape(e)], 1)
            return torch.cat([w1, w3], 1)

        scale = "scale" if fmt == "mxfp4" else "weight_scale"
        packed = PackedExperts(fmt, gate_up(None), gate_up(scale), stacked("w2", None),
                               stacked("w2", scale))  # fmt: skip
        if fmt == "nvfp4":
            packed.gate_up_scale_2 = gate_up("weight_scale_2")
            packed.down_scale_2 = stacked("w2", "weight_scale_2").reshape(e)
            if "input_scale" in self._quants[first].companions:
                packed.gate_up_input_scale = gate_up("input_scale")
                packed.down_input_scale = stacked("w2", "input_scale").reshape(e)
        return packed

    def _packed_hf(self, prefix: str) -> PackedExperts:
        base = f"model.{prefix}.mlp.experts."
        gu, down = base + "gate_up_proj", base + "down_proj"
        if gu not in self.index:
            raise KeyError(f"{gu} is not in the checkpoint")
        quants = self._quants[gu], self._quants[down]
        if any(q.fmt != "mxfp4" for q in quants):
            raise CheckpointError(f"{prefix}: HF routed experts are not packed MXFP4")

        def raw(name: str) -> torch.Tensor:
            t = self.get(name)
            return t.view(torch.uint8) if t.dtype == torch.int8 else t

        return PackedExperts(
            "mxfp4",
            raw(gu),
            raw(quants[0].companions["scale"]),
            raw(down),
            raw(quants[1].companions["scale"]),
        )
