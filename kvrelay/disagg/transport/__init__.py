"""Transfer backends behind one interface (base.py): tcp now; NIXL and others later."""

from __future__ import annotations

from kvrelay.disagg.transport.base import Transport


def make_transport(name: str) -> Transport:
    if name == "tcp":
        from kvrelay.disagg.transport.tcp import TcpTransport

        return TcpTransport()
    if name == "cuda_ipc":
        # Frames (headers) still go over TCP; the agents write the rows through CUDA IPC.
        from kvrelay.disagg.transport.tcp import TcpTransport

        return TcpTransport()
    raise ValueError(f"unknown transfer backend {name!r} (available: tcp, cuda_ipc)")
