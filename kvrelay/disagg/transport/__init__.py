"""Transfer backends behind one interface (base.py): tcp (framed.py), cuda_ipc (in_place.py) and
nixl (nixl.py: NIXL one-sided writes; needs the optional nixl package)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrelay.disagg.transport.base import Backend

if TYPE_CHECKING:
    import torch


def make_backend(name: str, checksum: bool, device: torch.device) -> Backend:
    if name == "tcp":
        from kvrelay.disagg.transport.framed import TcpBackend

        return TcpBackend(checksum)
    if name == "cuda_ipc":
        from kvrelay.disagg.transport.in_place import CudaIpcBackend

        return CudaIpcBackend(checksum, device)
    if name == "nixl":
        from kvrelay.disagg.transport.nixl import NixlBackend

        return NixlBackend(checksum, device)
    raise ValueError(f"unknown transfer backend {name!r} (available: tcp, cuda_ipc, nixl)")
