"""The tensor index of a DeepSeek-V4 checkpoint directory (from the safetensors headers) and the
naming it uses: DeepSeek native, HF-converted, or transformers' save_pretrained.

A save_pretrained checkpoint holds native per-layer names under `model.` (see `dsv4_names`):
`tensor_index` re-keys it by native names, so every later step (format detection, quantization
companions, expert stacking) treats it like a native checkpoint; `TensorInfo.stored` keeps the
name to read from the file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from kvrelay.quant import UnmappedNameError
from kvrelay.weights import hf_dir
from kvrelay.weights.dsv4_names import SAVED_LAYER_PREFIX, saved_to_native

NATIVE, HF, SAVED = "native", "hf", "transformers"


class CheckpointError(ValueError):
    """A checkpoint that does not match the model or is internally inconsistent."""


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str  # safetensors dtype string: BF16, F32, F8_E4M3, F8_E8M0, I8, U8, I64, ...
    shape: tuple[int, ...]
    stored: str  # the name inside the file


def _header(file: str) -> dict[str, Any]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def read_index(path: str) -> dict[str, TensorInfo]:
    """Every tensor of the directory (single file or sharded with an index), from the headers,
    under its stored name."""
    index: dict[str, TensorInfo] = {}
    for file in hf_dir.safetensors_files(path):
        for name, meta in _header(file).items():
            if name == "__metadata__":
                continue
            if name in index:
                raise CheckpointError(f"{name} is stored twice ({index[name].file}, {file})")
            index[name] = TensorInfo(file, meta["dtype"], tuple(meta["shape"]), name)
    return index


def detect_naming(index: dict[str, TensorInfo]) -> str:
    """native (`embed.weight`), hf (`model.layers.N.self_attn.*`) or transformers
    (save_pretrained: `model.layers.N.attn.*`), from the stored names."""
    if "embed.weight" in index:
        return NATIVE
    if "model.embed_tokens.weight" in index:
        return SAVED if any(SAVED_LAYER_PREFIX.match(n) for n in index) else HF
    raise CheckpointError(
        "no token embedding: expected embed.weight (DeepSeek native) or "
        "model.embed_tokens.weight (HF-converted, or transformers' save_pretrained)"
    )


def _as_native(index: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for name, info in index.items():
        try:
            native = saved_to_native(name)
        except UnmappedNameError as exc:
            raise CheckpointError(str(exc)) from None
        if native in out:
            raise CheckpointError(f"{name} and {out[native].stored} are both {native}")
        out[native] = info
    return out


def tensor_index(path: str) -> tuple[str, dict[str, TensorInfo]]:
    """(naming, index). A transformers save is indexed by native names (each entry keeps its
    stored name); the other namings by their stored names."""
    index = read_index(path)
    naming = detect_naming(index)
    return naming, _as_native(index) if naming == SAVED else index
