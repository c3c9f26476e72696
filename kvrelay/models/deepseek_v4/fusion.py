"""The elementwise glue between the fast path's GEMMs and kernels (RoPE, the QAT roundings, the
Hadamard rotation, the hyper-connection mixes, routing scores) fused by torch.compile.

Eagerly each of these is 5-30 small kernels (casts, muls, cats); a decode step of dsv4-mini ran
~3000 of them. A function marked `@fusable` runs compiled (inductor emits one or two Triton
kernels for it) while `fused_glue()` is active on the calling thread and its inputs are on a
GPU; otherwise it runs eagerly, so the per-sequence reference path and the CPU path stay the
plain torch code that the compiled form is tested against (`tests/gpu/test_dsv4_fusion.py`).
A fusable function never calls another fusable one (each compiles on its own).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

_ACTIVE = contextvars.ContextVar("kvrelay_fused_glue", default=False)
# Every call site's shapes, dtypes and flags compile their own variant of a function.
_RECOMPILE_LIMIT = 64


def fusable(fn: F) -> F:
    """Run `fn` compiled inside `fused_glue()` on GPU tensors, eagerly elsewhere; the eager
    function stays reachable as `.eager`."""
    compiled: Callable | None = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if not glue_active(args[0]):
            return fn(*args, **kwargs)
        if compiled is None:
            _raise_recompile_limit()
            # emulate_precision_casts: keep every explicit bf16 rounding of the eager code (by
            # default inductor drops a down-then-up cast pair inside a fused kernel)
            compiled = torch.compile(fn, fullgraph=True, options={"emulate_precision_casts": True})
        return compiled(*args, **kwargs)

    call.eager = fn  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


def glue_active(x: torch.Tensor) -> bool:
    """True where `@fusable` code would run compiled: `fused_glue()` active and x on a GPU (the
    fast path, where a hand-written Triton kernel may stand in for eager code too)."""
    return _ACTIVE.get() and x.is_cuda


@contextlib.contextmanager
def fused_glue(enabled: bool = True) -> Iterator[None]:
    """Within this block (this thread or task), `@fusable` functions on GPU inputs run compiled."""
    token = _ACTIVE.set(enabled)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _raise_recompile_limit() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if getattr(cfg, name, _RECOMPILE_LIMIT) < _RECOMPILE_LIMIT:
            setattr(cfg, name, _RECOMPILE_LIMIT)
