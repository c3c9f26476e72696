"""Finding a server's processes from outside it (fault injection, supervision tests)."""

from __future__ import annotations

import os


def engine_pid(server_pid: int) -> int:
    """The engine a `kvrelay serve` process spawned (not multiprocessing's resource tracker)."""
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            for pid in f.read().split():
                with open(f"/proc/{pid}/cmdline", "rb") as c:
                    cmd = c.read().decode(errors="replace")
                if "spawn_main" in cmd and "resource_tracker" not in cmd:
                    return int(pid)
    raise RuntimeError(f"no engine process under {server_pid}")
