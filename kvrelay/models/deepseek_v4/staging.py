"""Named int64 arrays in one device buffer, written on the host and sent in one copy: a graphed
decode step's dozen small inputs (ids, positions, page table, ...) reach the GPU in one
host-to-device transfer from pinned memory instead of a dozen synchronous ones."""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    def __init__(self, sizes: dict[str, int], device: torch.device) -> None:
        """`sizes`: each array's most elements, in the order they are laid out (arrays sent
        together should be neighbours)."""
        self.offset: dict[str, int] = {}
        at = 0
        for name, n in sizes.items():
            self.offset[name] = at
            at += n
        self.size = dict(sizes)
        self.on_device = torch.zeros(at, dtype=torch.long, device=device)
        host = torch.zeros(at, dtype=torch.long, pin_memory=device.type == "cuda")
        self._host_tensor = host
        self.host = host.numpy()

    def device(self, name: str, n: int | None = None) -> torch.Tensor:
        """The first n (all) elements of array `name` on the device: a view, stable for graphs."""
        o = self.offset[name]
        return self.on_device[o : o + (self.size[name] if n is None else n)]

    def put(self, name: str, values: np.ndarray) -> None:
        """values (flattened) into the front of array `name`, on the host."""
        v = np.asarray(values, dtype=np.int64).reshape(-1)
        if v.shape[0] > self.size[name]:
            raise ValueError(f"{name}: {v.shape[0]} values, room for {self.size[name]}")
        o = self.offset[name]
        self.host[o : o + v.shape[0]] = v

    def send(self, first: str, last: str, last_n: int | None = None) -> None:
        """Arrays `first` .. `last` (of `last`, its first last_n elements) to the device, in one
        copy (asynchronous from pinned memory: the host writes them again only after the step
        that reads them has been waited for)."""
        lo = self.offset[first]
        hi = self.offset[last] + (self.size[last] if last_n is None else last_n)
        self.on_device[lo:hi].copy_(self._host_tensor[lo:hi], non_blocking=True)
