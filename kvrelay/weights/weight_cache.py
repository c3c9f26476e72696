"""A GGUF model's weights as its parameters hold them after loading (dequantized, fused, in the
served dtype), kept on disk so that a later start maps them instead of building them again.

Each start of SmolLM2 dequantized its 98 MB GGUF (~1.3 s of CPU) and copied the result into
freshly allocated parameters (~1.2 s, most of it first-touch page faults of 540 MB). A start that
finds the entry maps the file (`torch.load(mmap=True)`: a private copy-on-write mapping, so
nothing the engine writes reaches the file) and hands the mapped tensors to the model as its
parameters: no dequantization, no copy, and the page cache is shared by every server of the
same model. torch's format puts each tensor at a 64-byte boundary, as a fresh allocation is.

The entry is keyed by the GGUF file (path, size, mtime), the dtype, the versions of torch, gguf
and numpy, and the text of the modules that turn the file into parameters (any edit to them is
a new entry). It is written to a temporary file and renamed into place, so that a reader never
sees half of it; writing it removes the older entries of the same file and dtype.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import tempfile
from pathlib import Path

import torch

from kvrelay.config import env

log = logging.getLogger("kvrelay.weights")

# The modules whose code decides the parameters' values, by import name.
_PRODUCERS = (
    "kvrelay.weights.gguf_file",
    "kvrelay.weights.gguf_reader",
    "kvrelay.weights.loader",
    "kvrelay.models.llama.model",
    __name__,
)


def entry_path(gguf_path: str, dtype: torch.dtype, nbytes: int) -> Path | None:
    """Where the weights of `gguf_path` in `dtype` (`nbytes` in all) are kept; None where
    nothing is kept (KVRELAY_CACHE_DIR=off, or larger than KVRELAY_WEIGHT_CACHE_MAX_GB)."""
    root = env("KVRELAY_CACHE_DIR")
    if root.strip().lower() == "off" or nbytes > float(env("KVRELAY_WEIGHT_CACHE_MAX_GB")) * 2**30:
        return None
    import gguf
    import numpy

    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    code = hashlib.sha256()
    for name in _PRODUCERS:
        code.update(Path(importlib.import_module(name).__file__).read_bytes())
    which = f"{real}|{dtype}"
    version = (
        f"{st.st_size}|{st.st_mtime_ns}|{torch.__version__}|{_version(gguf)}|"
        f"{numpy.__version__}|{code.hexdigest()}"
    )
    name = f"{_digest(which)}-{_digest(version)}.pt"
    return Path(root).expanduser() / "weights" / name


def load(path: Path, device: torch.device) -> dict[str, torch.Tensor] | None:
    """The kept parameters (mapped on the CPU, copied to another `device`), or None."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged entry: built again and rewritten
        log.warning("weight cache entry unreadable path=%s (%s): loading from the model", path, e)
        return None
    if device.type != "cpu":
        state = {k: v.to(device) for k, v in state.items()}
    return state


def save(path: Path, model: torch.nn.Module) -> None:
    """Keep `model`'s parameters at `path`; a failure (read-only or full disk) only warns."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pt")
        with os.fdopen(fd, "wb") as f:
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, f)
        os.replace(tmp, path)
        tmp = None
        stem = path.name.split("-")[0]
        for old in path.parent.glob(f"{stem}-*.pt"):
            if old != path:
                old.unlink(missing_ok=True)
    except OSError as e:
        log.warning("weight cache not written (%s); the weights are built each start", e)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _version(module) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module.__name__)
    except PackageNotFoundError:
        return getattr(module, "__version__", "?")
