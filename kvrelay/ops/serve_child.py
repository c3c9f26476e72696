"""One `kvrelay serve` child on a free port: started, health-gated and stopped (for `kvrelay ab`)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvrelay.ops.launcher import Launcher, LaunchError, _die_with_parent
from kvrelay.ops.replicas import free_port


class ServeChild:
    def __init__(self, args: list[str], log_path: Path, host: str = "127.0.0.1") -> None:
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "kvrelay.cli", "serve", "--host", host]
        argv += ["--port", str(self.port), *args]
        with open(log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,  # its engine too is stopped with the group
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2) as http:  # httpx.get: a client per call, ~30 ms of CPU
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise LaunchError(
                        f"`kvrelay serve` exited with code {self.proc.returncode}; "
                        f"see {self.log_path}"
                    )
                try:
                    if http.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        raise LaunchError(f"`kvrelay serve` not healthy within {timeout_s:g}s; see {self.log_path}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (the server stops its engine), then SIGKILL to the whole group if need be."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        Launcher._kill_group(self.proc.pid)
        self.proc.wait()
