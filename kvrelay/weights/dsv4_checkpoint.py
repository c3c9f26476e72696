"""DeepSeek-V4 checkpoint directories: detect naming and quantization, stream dequantized
tensors under the model's (HF) names, and hand out the packed routed experts.

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

import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvrelay.models.deepseek_v4.config import DeepseekV4Config
from kvrelay.quant import (
    DEFAULT_WEIGHT_BLOCK,
    ExpertSlot,
    UnmappedNameError,
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
)
from kvrelay.weights import hf_dir
from kvrelay.weights.dsv4_index import (
    HF,
    SAVED,
    CheckpointError,
    TensorInfo,
    tensor_index,
)
from kvrelay.weights.dsv4_names import is_native_name, native_to_model
from kvrelay.weights.dsv4_shard import shard

log = logging.getLogger("kvrelay.weights")

ARCHITECTURE = "DeepseekV4ForCausalLM"
_NATIVE_V4_KEYS = ("compress_ratios", "hc_mult", "o_groups")
_PACKED_DTYPES = ("I8", "U8")
_NVFP4_LEAVES = ("weight_scale", "weight_scale_2", "input_scale")


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
    if fmt.experts in _PACKED_FORMATS:
        mtp = fmt.mtp_experts or fmt.experts
        cfg = cfg.with_(
            expert_format=fmt.experts,
            mtp_expert_format=mtp if mtp in _PACKED_FORMATS else "dense",
        )
    return cfg, raw


def read_config(path: str) -> DeepseekV4Config:
    """The model config of a checkpoint directory (the registry's config reader)."""
    return read_dsv4_config(path)[0]


# --- per-tensor format ------------------------------------------------------------------------


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))


@dataclass(frozen=True)
class Quant:
    """How one stored weight is encoded: fmt in none | fp8_block | mxfp4 | nvfp4, and the names
    of its companion tensors by role (scale; or weight_scale, weight_scale_2, input_scale)."""

    fmt: str
    companions: dict[str, str]


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
    hits = sorted((n for n in index if rx.fullmatch(n)), key=_natural_key)
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


def dequantize(
    weight: torch.Tensor,
    quant: Quant,
    parts: dict[str, torch.Tensor],
    dtype: torch.dtype,
    block: tuple[int, int] = DEFAULT_WEIGHT_BLOCK,
) -> torch.Tensor:
    """A stored weight and its companion tensors (by role) -> the dense tensor in `dtype`
    (unquantized weights come back as stored)."""
    if quant.fmt == "none":
        return weight
    if quant.fmt == "fp8_block":
        return dequantize_fp8_block(weight, parts["scale"], block, dtype)
    if quant.fmt == "mxfp4":
        return dequantize_mxfp4(weight, parts["scale"], dtype)
    if quant.fmt == "nvfp4":
        return dequantize_nvfp4(weight, parts["weight_scale"], parts["weight_scale_2"], dtype)
    raise CheckpointError(f"unknown quantization {quant.fmt!r}")


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
        return sorted(names, key=lambda n: (order[self.index[n].file], _natural_key(n)))

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


# --- loading into the model -------------------------------------------------------------------


@torch.no_grad()
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


_PACKED_FORMATS = ("nvfp4", "mxfp4")  # routed experts the model keeps packed
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
