"""Batch-invariant mode (`--deterministic`): a token's result does not depend on what else is in
its batch, nor on where its prompt's prefill chunks were cut.

Why the default ops are not invariant: torch picks a kernel by shape. On the CPU a float32
matmul of M=1 rows runs a GEMV whose dot products sum in another order than the GEMM of M>1
(a row's logits differ between batch 1 and batch 2), bf16 GEMMs change blocking with M, and
attention reduces over as many keys as the batch's longest context brings. The cure here is one
rule: every op that reduces runs on tensors of a FIXED shape, in a fixed order, so a row always
meets the same kernel. A fixed-shape GEMM computes each row the same way at any position in the
block (measured: tests/layers/test_batch_invariant.py).

`scope(on)` is the switch the runners enter around a forward: inside it the torch dispatch mode
below cuts token-major ops into blocks of exactly ROWS rows (the last one zero-padded); outside
it nothing changes. Attention needs more than blocking (its reduction length follows the batch):
kvrelay/layers/batch_invariant_attention.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
ROWS = 16  # rows per block: every blocked op sees [ROWS, ...] whatever the batch


def in_row_blocks(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """fn over xs' first dim (the same length in each) in blocks of exactly ROWS rows, the last
    block zero-padded and its padding dropped from the result: every call has one shape."""
    n = xs[0].shape[0]
    if n in (0, ROWS):  # one block already (or nothing)
        return fn(*xs)
    pad = -n % ROWS
    if pad:
        xs = tuple(torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in xs)
    return torch.cat([fn(*b) for b in zip(*(x.split(ROWS) for x in xs), strict=True)])[:n]


def _rows_of(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn over the rows of x's leading dims (flattened), blocked; x [..., K] -> [..., N]."""
    flat = x.reshape(-1, x.shape[-1])
    out = in_row_blocks(fn, flat)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _linear(x, w, bias=None):
    return _rows_of(x, lambda b: F.linear(b, w, bias))


def _mm(a, b):
    return in_row_blocks(lambda blk: torch.mm(blk, b), a)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    prod = _mm(a, b)
    return bias * beta + prod * alpha if (beta, alpha) != (1, 1) else bias + prod


def _matmul(a, b):
    if b.dim() != 2 or a.dim() < 2:  # batched: callers keep those shapes fixed themselves
        return NotImplemented
    return _rows_of(a, lambda blk: torch.mm(blk, b))


def _einsum(equation: str, operands, path=None):
    """Block the leading letter of the output over every operand it leads (tokens times a
    weight: "ngi,gri->ngr"; per-row batched products: "nhd,nkd->nhk")."""
    ins, out = equation.replace(" ", "").split("->")
    subs = ins.split(",")
    lead = out[:1]
    if not lead or any(lead in s and not s.startswith(lead) for s in subs):
        return NotImplemented
    blocked = [i for i, s in enumerate(subs) if s.startswith(lead)]
    rows = {operands[i].shape[0] for i in blocked}
    if len(rows) != 1:  # a broadcast leading dim: leave it alone
        return NotImplemented

    def run(*blocks):
        ops = list(operands)
        for i, blk in zip(blocked, blocks, strict=True):
            ops[i] = blk
        return aten.einsum.default(equation, ops, path=path)

    return in_row_blocks(run, *(operands[i] for i in blocked))


def _keeps_rows(x: torch.Tensor, dims) -> bool:
    """A reduction over `dims` that leaves dim 0 (the rows) alone."""
    if x.dim() < 2:
        return False
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return bool(dims) and all(d % x.dim() != 0 for d in dims)


def _reduce(op):
    """sum / mean over dims other than 0, blocked over the rows."""

    def run(x, dims, keepdim=False, *, dtype=None):
        if not _keeps_rows(x, dims):
            return NotImplemented
        return in_row_blocks(lambda b: op(b, dims, keepdim, dtype=dtype), x)

    return run


def _softmax(op):
    def run(x, dim, half_to_float):
        if not _keeps_rows(x, dim):
            return NotImplemented
        return in_row_blocks(lambda b: op(b, dim, half_to_float), x)

    return run


# Elementwise math whose vectorised CPU kernel rounds differently from its scalar tail loop (an
# element gets other bits depending on whether it falls in a full vector or the tail, i.e. on
# the tensor's size): sigmoid of a [T, 4] gate at T=1 (4 elements, all in the tail) vs T=8.
# The exact-by-IEEE ops (add, mul, div, sqrt, rsqrt, reciprocal) need nothing.
_TRANSCENDENTAL = [
    aten.exp, aten.exp2, aten.expm1, aten.log, aten.log2, aten.log1p, aten.sigmoid, aten.silu,
    aten.softplus, aten.tanh, aten.erf, aten.gelu, aten.sin, aten.cos,
]  # fmt: skip
# Elements per call: a multiple of every vector loop's unroll (2 x 32 bf16 lanes), so nothing
# reaches a tail, and below the grain at which the CPU splits an op over threads (32768).
ELEMENT_BLOCK = 16384
ELEMENT_ALIGN = 64


def _elementwise(op):
    """op over x flattened, zero-padded to a multiple of ELEMENT_ALIGN, in ELEMENT_BLOCK pieces:
    every element runs through the vector loop, whatever the tensor's size."""

    def run(x, *args, **kwargs):
        if not x.is_floating_point() or x.numel() == 0:
            return NotImplemented
        n = x.numel()
        if n % ELEMENT_ALIGN == 0 and n <= ELEMENT_BLOCK and x.is_contiguous():
            return op(x, *args, **kwargs)  # one contiguous piece with no tail already
        flat = x.reshape(-1)
        if n % ELEMENT_ALIGN:
            flat = torch.cat([flat, flat.new_zeros(-n % ELEMENT_ALIGN)])
        out = torch.cat([op(b, *args, **kwargs) for b in flat.split(ELEMENT_BLOCK)])
        return out[:n].view(x.shape)

    return run


def _elementwise_inplace(op):
    out_of_place = _elementwise(op)

    def run(x, *args, **kwargs):
        out = out_of_place(x, *args, **kwargs)
        return out if out is NotImplemented else x.copy_(out)

    return run


_HANDLERS = {
    aten.linear.default: _linear,
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.matmul.default: _matmul,
    aten.einsum.default: _einsum,
    aten.sum.dim_IntList: _reduce(torch.sum),
    aten.mean.dim: _reduce(torch.mean),
    aten._softmax.default: _softmax(aten._softmax.default),
    aten._log_softmax.default: _softmax(aten._log_softmax.default),
    **{op.default: _elementwise(op.default) for op in _TRANSCENDENTAL},
    **{
        getattr(aten, op.__name__ + "_").default: _elementwise_inplace(op.default)
        for op in _TRANSCENDENTAL
        if hasattr(aten, op.__name__ + "_")
    },
}


class BatchInvariantOps(TorchDispatchMode):
    """Matmuls of rows by a weight, einsums led by the rows, and sums / means / softmaxes that
    keep the rows run in blocks of ROWS rows; transcendental elementwise ops in fixed-size
    vector-only pieces; every other op (exact elementwise, gathers, max) is invariant as it is
    and passes through. Inside a handler the mode is off (no recursion)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def scope(on: bool):
    """The batch-invariant mode when `on` (a runner's `deterministic` config), else nothing.
    Under inference mode, as the runners run: there composite ops (linear, einsum, matmul)
    reach the mode whole; with autograd on they would arrive decomposed, their rows unknown."""
    if not on:
        yield
        return
    with torch.inference_mode(), BatchInvariantOps():
        yield


def check_supported(cfg, device: torch.device | str) -> None:
    """Refuse, at startup, what `--deterministic` cannot make invariant yet (never run the
    non-invariant path silently)."""
    if not cfg.deterministic:
        return
    if torch.device(device).type != "cpu":
        raise ValueError(
            "--deterministic runs on the CPU only, so far: the Triton kernels (split-K decode "
            "attention, varlen attention, sparse MQA, indexer, fused MoE, fused norms) and the "
            "CUDA-graph runners have no batch-invariant variant yet (--device cpu runs it)"
        )
    if cfg.attention_backend in ("triton", "reference"):
        raise ValueError(
            f"--deterministic needs the torch attention backend, not {cfg.attention_backend!r} "
            "(the reference path attends per sequence with widths that follow the chunking)"
        )
    if cfg.tensor_parallel_size > 1:
        raise ValueError(
            "--deterministic with tensor parallel is not supported yet: an all-reduce sums a "
            "row in an order that follows the message size, hence the batch"
        )
