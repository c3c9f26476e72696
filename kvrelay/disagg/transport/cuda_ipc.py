"""Same-host GPU memory sharing for KV transfer: decode exports its cache tensors as CUDA IPC
handles, prefill opens them and writes pages straight into decode's memory (a device-to-device
copy; peer-to-peer when the two processes use different GPUs of one host). Headers keep
travelling as frames over the connection; only the payload moves this way, which is the shape a
NIXL backend (registered memory + remote writes) has too.

Integrity: both sides compute `device_checksum` on the GPU, prefill over what it wrote (after
the copy completed) and decode over its destination rows once the header arrives.
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.multiprocessing.reductions import reduce_tensor


def export_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """CUDA IPC handles of `tensors` (views keep their offsets into the shared storage)."""
    return pickle.dumps({name: reduce_tensor(t) for name, t in tensors.items()})


class _TorchOnly(pickle.Unpickler):
    """Handles come from a peer: rebuild tensors, never run anything else."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a CUDA IPC descriptor")


def open_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    """Peer tensors from `export_tensors` (must run in another process than the exporter)."""
    handles = _TorchOnly(io.BytesIO(blob)).load()
    return {name: rebuild(*args) for name, (rebuild, args) in handles.items()}


_MOD = 2**31 - 1


def device_checksum(t: torch.Tensor) -> int:
    """A position-weighted sum of the bytes' 32-bit words (mod 2^31-1): any changed, swapped or
    misplaced word changes it. One pass on the GPU; returns a Python int (synchronises)."""
    words = _words(t)
    weights = torch.arange(1, words.numel() + 1, device=t.device, dtype=torch.int64) % _MOD
    return int(((words % _MOD) * weights % _MOD).sum().item() % _MOD)


def _words(t: torch.Tensor) -> torch.Tensor:
    flat = t.contiguous().view(torch.uint8).flatten()
    pad = (-flat.numel()) % 4
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return flat.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
