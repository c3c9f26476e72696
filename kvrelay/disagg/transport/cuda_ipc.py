"""Same-host GPU memory sharing for KV transfer: decode exports its cache tensors as CUDA IPC
handles, prefill opens them and writes pages straight into decode's memory (a device-to-device
copy; peer-to-peer when the two processes use different GPUs of one host). Headers keep
travelling as frames over the connection; only the payload moves this way, which is the shape a
NIXL backend (registered memory + remote writes) has too.

The handles travel as typed fields (protocol.IpcTensor), checked here and rebuilt with torch's
explicit constructor: nothing a peer sends is ever unpickled or imported.

Integrity: both sides compute `device_checksum` on the GPU, prefill over what it wrote (after
the copy completed) and decode over its destination rows once the header arrives.
"""

from __future__ import annotations

import re

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from kvrelay.disagg.protocol import IpcTensor

# The dtypes a shared tensor may have (the cache kinds travel as uint8 byte rows): a name on the
# wire, looked up here, never resolved by import.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}
REF_COUNTER_SLOTS = 10000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: int64 counters per file
_SHM_NAME = re.compile(rb"/[A-Za-z0-9_.-]{1,250}")  # a POSIX shared-memory name, one component


class IpcDescriptorError(ValueError):
    """A CUDA IPC tensor description that cannot be a tensor of a peer's cache."""


def export_tensors(tensors: dict[str, torch.Tensor]) -> list[IpcTensor]:
    """CUDA IPC handles of `tensors`, as plain typed fields (views keep their offsets into the
    shared storage). The same fields `torch.multiprocessing.reductions.reduce_tensor` pickles."""
    out = []
    for name, t in tensors.items():
        if t.device.type != "cuda" or t.untyped_storage().nbytes() == 0:
            raise ValueError(f"{name}: only non-empty CUDA tensors can be shared")
        (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, sync) = (
            t.untyped_storage()._share_cuda_()
        )
        out.append(
            IpcTensor(
                name=name,
                dtype=str(t.dtype).removeprefix("torch."),
                shape=list(t.shape),
                stride=list(t.stride()),
                storage_offset=t.storage_offset(),
                device=device,
                handle=handle,
                storage_size_bytes=size_bytes,
                storage_offset_bytes=offset_bytes,
                ref_counter_handle=ref_handle,
                ref_counter_offset=ref_offset,
                event_handle=event_handle or b"",
                event_sync_required=bool(sync),
            )
        )
    return out


def check(h: IpcTensor) -> torch.dtype:
    """Everything a peer's description must satisfy before torch sees it; returns its dtype."""
    dtype = DTYPES.get(h.dtype)
    if dtype is None:
        raise IpcDescriptorError(f"{h.name}: dtype {h.dtype!r} is not one of {sorted(DTYPES)}")
    if len(h.shape) != len(h.stride) or not h.shape:
        raise IpcDescriptorError(f"{h.name}: shape {h.shape} and stride {h.stride} do not match")
    if h.storage_size_bytes == 0 or not h.handle:
        raise IpcDescriptorError(f"{h.name}: an empty storage")
    if all(n > 0 for n in h.shape):
        last = h.storage_offset + sum((n - 1) * s for n, s in zip(h.shape, h.stride, strict=True))
        if (last + 1) * dtype.itemsize > h.storage_size_bytes:
            raise IpcDescriptorError(
                f"{h.name}: a {h.shape} view (stride {h.stride}, offset {h.storage_offset}) "
                f"reaches past its {h.storage_size_bytes}-byte storage"
            )
    if not _SHM_NAME.fullmatch(h.ref_counter_handle):
        why = f"reference counter {h.ref_counter_handle!r} is not a shared-memory name"
        raise IpcDescriptorError(f"{h.name}: {why}")
    if h.ref_counter_offset >= REF_COUNTER_SLOTS:
        why = f"reference counter slot {h.ref_counter_offset} is out of range"
        raise IpcDescriptorError(f"{h.name}: {why}")
    if h.event_sync_required and not h.event_handle:
        raise IpcDescriptorError(f"{h.name}: an event to wait for, but no event handle")
    return dtype


def open_tensors(handles: list[IpcTensor]) -> dict[str, torch.Tensor]:
    """Peer tensors from `export_tensors` (must run in another process than the exporter). Every
    description is checked before any is opened; opening calls torch's CUDA IPC constructor with
    those checked values only."""
    dtypes = [check(h) for h in handles]
    names = [h.name for h in handles]
    if len(set(names)) != len(names):
        raise IpcDescriptorError("a cache kind is named twice")
    count = torch.cuda.device_count()
    for h in handles:
        if h.device >= count:
            raise IpcDescriptorError(f"{h.name}: device {h.device}, this process sees {count}")
    return {h.name: _rebuild(h, dtype) for h, dtype in zip(handles, dtypes, strict=True)}


def _rebuild(h: IpcTensor, dtype: torch.dtype) -> torch.Tensor:
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(h.shape),
        tuple(h.stride),
        h.storage_offset,
        torch.storage.TypedStorage,  # what reduce_tensor names: type(tensor._typed_storage())
        dtype,
        h.device,
        h.handle,
        h.storage_size_bytes,
        h.storage_offset_bytes,
        False,  # requires_grad
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )


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
