"""Where a result came from: package versions, the git commit of this checkout, the device name."""

from __future__ import annotations

import platform
import subprocess
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGES = ("kvrelay", "torch", "transformers", "triton")


def versions() -> dict[str, str | None]:
    """Installed versions (from package metadata: nothing is imported), and Python's."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


@cache
def git_commit() -> dict | None:
    """{'commit', 'dirty'} of the git checkout kvrelay runs from; None when it is not one (an
    installed wheel) or git is missing."""
    pkg = Path(__file__).resolve().parent
    try:
        top = _git(pkg, "rev-parse", "--show-toplevel")
        # A wheel inside some other repository (a venv in a project) is not our checkout.
        if top is None or (Path(top) / "kvrelay").resolve() != pkg:
            return None
        commit = _git(pkg, "rev-parse", "HEAD")
        status = _git(pkg, "status", "--porcelain", "--untracked-files=no")
    except OSError:
        return None
    if commit is None:
        return None
    return {"commit": commit, "dirty": bool(status)}


def _git(cwd: Path, *args: str) -> str | None:
    r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    return r.stdout.strip() if r.returncode == 0 else None


def device_name(device: str) -> str:
    """'cpu', or the GPU's name for a 'cuda[:N]' device (reads properties; allocates nothing)."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    index = int(device.split(":")[1]) if ":" in device else 0
    try:
        return torch.cuda.get_device_name(index)
    except (RuntimeError, AssertionError) as e:
        return f"{device} (name unknown: {e})"
