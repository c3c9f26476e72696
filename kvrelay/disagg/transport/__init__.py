"""Transfer backends behind one interface (base.py): tcp now; NIXL and others later."""

from __future__ import annotations

from kvrelay.disagg.transport.base import Transport


def make_transport(name: str) -> Transport:
    if name == "tcp":
        from kvrelay.disagg.transport.tcp import TcpTransport

        return TcpTransport()
    raise ValueError(f"unknown transfer backend {name!r} (available: tcp)")
