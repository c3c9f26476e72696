"""A GGUF file's metadata and tensor table, read with plain struct reads over a memory map.

gguf's own reader builds numpy views for every metadata value (~150k of them for a 49k-token
vocabulary: ~2 s per process, paid by the API and the engine of every server start); this reads
the same layout in a single pass. Layout (little-endian): magic "GGUF", version u32, tensor count
u64, metadata count u64; metadata: key string, type u32, value; tensor infos: name, n_dims u32,
dims u64 x n (fastest first), type u32, offset u64; tensor data from the next multiple of
`general.alignment` (default 32). A string is a u64 length and UTF-8 bytes; an array is an element
type u32, a count u64 and the elements.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
# Unquantized tensor types are read as typed arrays, every other type as its raw bytes.
_PLAIN = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    n_bytes: int
    data_offset: int
    data: np.ndarray  # typed (unquantized) or raw bytes [..., bytes per row], row-major


class GGUFFile:
    """`fields`: metadata key -> Python value (arrays as lists); `tensors` in file order."""

    def __init__(self, path: str) -> None:
        self._buf = np.memmap(path, mode="r").view(np.ndarray)
        self._mv = memoryview(self._buf)
        if bytes(self._mv[:4]) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
        self._pos = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (big-endian?)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = self.fields.get("general.alignment", 32)
        self.data_offset = -(-self._pos // align) * align
        self.tensors = [self._tensor(*info) for info in infos]

    def _scalar(self, vtype: int):
        fmt = _SCALARS[vtype]
        (v,) = struct.unpack_from(fmt, self._mv, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar(10)
        s = str(self._mv[self._pos : self._pos + n], "utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            return self._scalar(vtype)
        etype, count = self._scalar(4), self._scalar(10)
        if etype in _SCALARS and etype != 7:  # numbers: one frombuffer for the whole array
            dt = np.dtype(_SCALARS[etype])
            arr = np.frombuffer(self._buf, dt, count, self._pos)
            self._pos += dt.itemsize * count
            return arr.tolist()
        return [self._value(etype) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._scalar(4)
        dims = tuple(self._scalar(10) for _ in range(n_dims))
        return name, dims, self._scalar(4), self._scalar(10)

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> GGUFTensor:
        qtype = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(dims)) * type_size // block
        start = self.data_offset + offset
        raw = self._buf[start : start + n_bytes]
        np_dims = tuple(reversed(dims))
        if qtype in _PLAIN:
            data = raw.view(_PLAIN[qtype]).reshape(np_dims)
        else:
            data = raw.reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
        return GGUFTensor(name, qtype, dims, n_bytes, start, data)
