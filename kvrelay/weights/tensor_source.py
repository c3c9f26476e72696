"""Lazy checkpoint tensors: read any box of a stored, quantized or fused tensor, touching only the
bytes that box needs (safetensors slices), so a tensor-parallel rank never reads what it drops.

A `Source` has the full (logical, dequantized) shape and `read(box)` with one slice per dim:
- `Stored`: a tensor as stored, through `SafetensorsReader` (the one place bytes are read).
- `Dequantized`: an FP8-block / MXFP4 / NVFP4 weight and its scales: the box of the weight and
  the scale blocks covering it (a block cut by the box is read by both ranks: scales are small),
  dequantized elementwise, so the values are exactly those of dequantizing the whole tensor.
- `Cat` / `Stack`: fused tensors made of stored pieces (gate|up halves, per-expert matrices).
- `Reshaped`: a tiny tensor read whole under another shape (per-expert NVFP4 global scales).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from kvrelay.quant.encoding import Quant, dequantize

Box = tuple[slice, ...]  # one slice (step 1, bounds set) per dim


def full_box(shape: Sequence[int]) -> Box:
    return tuple(slice(0, n) for n in shape)


def box_with(shape: Sequence[int], dim: int, start: int, stop: int) -> Box:
    """The whole of `shape` except [start, stop) along `dim`."""
    box = list(full_box(shape))
    box[dim] = slice(start, stop)
    return tuple(box)


class SafetensorsReader:
    """Opens checkpoint files once each and reads boxes of their tensors (memory-mapped: only the
    bytes of the box are copied). Tests subclass it to count what each rank reads."""

    def __init__(self) -> None:
        self._files: dict[str, Any] = {}

    def _open(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._files:
            self._files[file] = safe_open(file, framework="pt")
        return self._files[file]

    def shapes(self, file: str) -> dict[str, tuple[int, ...]]:
        """Every tensor of `file` and its shape (from the header: nothing is read)."""
        f = self._open(file)
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}

    def read(self, file: str, name: str, box: Box) -> torch.Tensor:
        return self._open(file).get_slice(name)[box]

    def close(self) -> None:
        self._files.clear()


class Source(Protocol):
    shape: tuple[int, ...]

    def read(self, box: Box) -> torch.Tensor: ...


class Stored:
    def __init__(self, reader: SafetensorsReader, file: str, name: str, shape: Sequence[int]):
        self.reader, self.file, self.name, self.shape = reader, file, name, tuple(shape)

    def read(self, box: Box) -> torch.Tensor:
        return self.reader.read(self.file, self.name, box)


# Scale block per format over the last dims of the logical weight; FP4 packs 2 values a byte.
_BLOCKS = {"mxfp4": (1, 32), "nvfp4": (1, 16)}
_PACKED = ("mxfp4", "nvfp4")


class Dequantized:
    """A quantized weight read box by box and dequantized (see `quant.encoding.dequantize`)."""

    def __init__(
        self,
        weight: Stored,
        fmt: str,
        parts: dict[str, Stored],
        dtype: torch.dtype,
        block: tuple[int, int],
    ) -> None:
        self.weight, self.parts, self.dtype, self.block = weight, parts, dtype, tuple(block)
        self.quant = Quant(fmt, {role: s.name for role, s in parts.items()})
        pack = 2 if fmt in _PACKED else 1
        self.shape = (*weight.shape[:-1], weight.shape[-1] * pack)
        self.pack = pack
        self.blocks = (
            (1,) * (len(self.shape) - 2) + (_BLOCKS.get(fmt) or self.block)
        )  # fmt: skip

    def read(self, box: Box) -> torch.Tensor:
        # Only the box's own bytes are read; the scale grid must start at a block edge, so the
        # weight is front-padded with zeros to the edge of its first block (cut off again).
        lead = tuple(s.start % b for s, b in zip(box, self.blocks, strict=True))
        scales = tuple(
            slice(s.start // b, -(-s.stop // b)) for s, b in zip(box, self.blocks, strict=True)
        )
        last = box[-1]
        w = self.weight.read((*box[:-1], slice(last.start // self.pack, last.stop // self.pack)))
        if any(lead):
            pad = (*lead[:-1], lead[-1] // self.pack)
            padded = w.new_zeros([n + p for n, p in zip(w.shape, pad, strict=True)])
            padded[tuple(slice(p, None) for p in pad)] = w
            w = padded
        parts = {}
        for role, src in self.parts.items():
            # global and input scales are per matrix (a scalar per stored weight): read whole
            parts[role] = src.read(
                scales if role in ("scale", "weight_scale") else full_box(src.shape)
            )
        t = dequantize(w, self.quant, parts, self.dtype, self.block)
        return t[tuple(slice(p, None) for p in lead)]


class Cat:
    """Pieces concatenated along `dim` (e.g. an expert's [w1; w3] rows)."""

    def __init__(self, pieces: Sequence[Source], dim: int) -> None:
        self.pieces, self.dim = list(pieces), dim
        first = pieces[0].shape
        size = sum(p.shape[dim] for p in pieces)
        self.shape = (*first[:dim], size, *first[dim + 1 :])

    def read(self, box: Box) -> torch.Tensor:
        want, out, offset = box[self.dim], [], 0
        for p in self.pieces:
            lo, hi = max(want.start, offset), min(want.stop, offset + p.shape[self.dim])
            if lo < hi:
                sub = list(box)
                sub[self.dim] = slice(lo - offset, hi - offset)
                out.append(p.read(tuple(sub)))
            offset += p.shape[self.dim]
        return torch.cat(out, self.dim)


class Stack:
    """Equal-shaped pieces stacked along a new dim 0 (experts): only the boxed ones are read."""

    def __init__(self, pieces: Sequence[Source]) -> None:
        self.pieces = list(pieces)
        self.shape = (len(pieces), *pieces[0].shape)

    def read(self, box: Box) -> torch.Tensor:
        return torch.stack([self.pieces[i].read(box[1:]) for i in range(box[0].start, box[0].stop)])


class Reshaped:
    """A tiny tensor read whole and viewed as `shape` (a scalar as [1])."""

    def __init__(self, src: Source, shape: Sequence[int]) -> None:
        self.src, self.shape = src, tuple(shape)

    def read(self, box: Box) -> torch.Tensor:
        return self.src.read(full_box(self.src.shape)).reshape(self.shape)[box]
