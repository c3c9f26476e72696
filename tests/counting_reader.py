"""The real safetensors reader, recording how many bytes each stored tensor gave up (tests of
per-rank loading: a rank must read only the slices it keeps)."""

from __future__ import annotations

from collections import defaultdict

from kvrelay.weights.tensor_source import SafetensorsReader


class CountingReader(SafetensorsReader):
    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)

    def read(self, file, name, box):
        t = super().read(file, name, box)
        self.bytes[name] += t.numel() * t.element_size()
        return t
