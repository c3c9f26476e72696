"""Batch-invariant mode (`--deterministic`): a token's result does not depend on what else is in
its batch, nor on where its prompt's prefill chunks were cut.

Why the default ops are not invariant: torch picks a kernel by shape. On the CPU a float32
matmul of M=1 rows runs a GEMV whose dot products sum in another order than the GEMM of M>1
(a row's logits differ between batch 1 and batch 2), bf16 GEMMs change blocking with M, and
attention reduces over as many keys as the batch's longest context brings. The cure here is one
rule: every op that reduces runs on tensors of a FIXED shape, in a fixed order, so a row always
meets the same kernel. A fixed shape is not quite enough: the kernel may still treat the rows of
its block unevenly (MKL's AVX2 sgemm with 2 threads computes rows 6, 7, 14 and 15 of a [16, 256]
x [256, 24] block in another order than the rest; its AVX-512 one does not), so each blocked op
is checked once per shape on the machine it runs on (`_row_alike`) and run in the first form
that computes a row alike at every position of its block, else one row per call.

`scope(on)` is the switch the runners enter around a forward: inside it the torch dispatch mode
below cuts token-major ops into blocks of exactly ROWS rows (the last one zero-padded); outside
it nothing changes. Attention needs more than blocking (its reduction length follows the batch):
kvrelay/layers/batch_invariant_attention.py.

On the GPU the matmul handlers call a fixed-tile Triton kernel instead of blocking
(kernels/triton_invariant_linear.py: no probe, nothing but a launch, so CUDA graphs capture it).
Dense attention is a Triton kernel of its own (kernels/triton_invariant_attention.py); the dense
forward's other GPU ops are Triton kernels of one program per row, invariant as they are.
DeepSeek-V4 runs its Triton kernels with schedules fixed by shapes alone (its runnable's
`_pick_ops`) and its glue eagerly (not compiled: inductor picks a reduction's tiles from the row
count), so the glue's reductions and top-k meet the blocking here; CUDA elementwise ops pass
through (one function per element, whatever the size).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
ROWS = 16  # rows per block: every blocked op sees [ROWS, ...] whatever the batch


BlockFn = Callable[..., torch.Tensor]
# (op key, block shapes, dtypes, threads) -> the form of the op that computes a row alike at every
# position of a ROWS block on this machine, or None: none does, run one row per call.
_FORMS: dict[tuple, BlockFn | None] = {}


def in_row_blocks(
    fn: BlockFn, *xs: torch.Tensor, key: tuple = (), forms: tuple[BlockFn, ...] = ()
) -> torch.Tensor:
    """fn over xs' first dim (the same length in each) in blocks of exactly ROWS rows, the last
    block zero-padded and its padding dropped from the result: every call has one shape.

    `key` names what else decides the kernel (the op, its other operands' shapes and dtypes);
    `fn` and then each of `forms` (the same result computed another way) is checked once per
    key for computing every row of a block alike (`_row_alike`); where none does, every row
    runs alone, a fresh [1, ...] tensor per call."""
    n = xs[0].shape[0]
    if n == 0:
        return fn(*xs)
    # Contiguous, as the padded block and the probe are: a strided view may meet other kernels.
    xs = tuple(x.contiguous() for x in xs)
    full = (
        key, tuple((x.shape[1:], x.dtype, x.device.type) for x in xs), torch.get_num_threads()
    )  # fmt: skip
    if full not in _FORMS:
        if xs[0].is_cuda and torch.cuda.is_current_stream_capturing():
            # A probe syncs, which a capture forbids. The keys hold no row count, so the eager
            # warm-up before any capture has met them; a new one here is trusted as it is.
            _FORMS[full] = fn
        else:
            _FORMS[full] = next((f for f in (fn, *forms) if _row_alike(f, xs)), None)
    form = _FORMS[full]
    if form is None:
        return torch.cat([fn(*(x[i : i + 1].clone() for x in xs)) for i in range(n)])
    if n == ROWS:  # one block already
        return form(*xs)
    pad = -n % ROWS
    if pad:
        xs = tuple(torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in xs)
    return torch.cat([form(*b) for b in zip(*(x.split(ROWS) for x in xs), strict=True)])[:n]


def _row_alike(fn: BlockFn, xs: tuple[torch.Tensor, ...]) -> bool:
    """Does fn give a row the same bits at every position of a ROWS block? A block of random
    rows against the same rows moved down by one (cyclically): a kernel that treats some
    positions otherwise has two neighbouring positions that differ, and this compares every
    neighbouring pair. Which rows a kernel treats how follows from the shapes (tiles, the
    split over threads), not from the values."""
    g = torch.Generator().manual_seed(0)

    def probe(x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return x[:1].expand(ROWS, *x.shape[1:]).clone()  # indices: any valid ones
        r = torch.randn(ROWS, *x.shape[1:], generator=g, dtype=torch.float32)
        return r.to(device=x.device, dtype=x.dtype)

    block = [probe(x) for x in xs]
    return torch.equal(fn(*block).roll(1, 0), fn(*(b.roll(1, 0) for b in block)))


def _rows_of(
    x: torch.Tensor, fn: BlockFn, key: tuple = (), forms: tuple[BlockFn, ...] = ()
) -> torch.Tensor:
    """fn over the rows of x's leading dims (flattened), blocked; x [..., K] -> [..., N]."""
    flat = x.reshape(-1, x.shape[-1])
    out = in_row_blocks(fn, flat, key=key, forms=forms)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _operand_key(*ts) -> tuple:
    return tuple(
        (tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t for t in ts
    )


def _gpu_linear(x, w, bias=None):
    """On the GPU every matmul of rows by a weight runs the fixed-tile Triton kernel (cuBLAS
    picks tiles and split-K from M): no blocking, no probe, graph capture takes it."""
    from kvrelay.kernels.triton_invariant_linear import invariant_linear

    return invariant_linear(x, w, bias)


def _linear(x, w, bias=None):
    if x.is_cuda:
        return _gpu_linear(x, w, bias)

    def lanes(b):  # the block's rows on the GEMM's other side: [N, ROWS], transposed back
        out = torch.mm(w, b.t()).t().contiguous()
        return out if bias is None else out + bias

    return _rows_of(x, lambda b: F.linear(b, w, bias), ("linear", *_operand_key(w, bias)), (lanes,))


def _mm(a, b):
    if a.is_cuda:
        return _gpu_linear(a, b.t())
    return in_row_blocks(
        lambda blk: torch.mm(blk, b),
        a,
        key=("mm", *_operand_key(b)),
        forms=(lambda blk: torch.mm(b.t(), blk.t()).t().contiguous(),),
    )


def _addmm(bias, a, b, *, beta=1, alpha=1):
    prod = _mm(a, b)
    return bias * beta + prod * alpha if (beta, alpha) != (1, 1) else bias + prod


def _matmul(a, b):
    if b.dim() != 2 or a.dim() < 2:  # batched: callers keep those shapes fixed themselves
        return NotImplemented
    if a.is_cuda:
        return _gpu_linear(a, b.t())
    return _rows_of(
        a,
        lambda blk: torch.mm(blk, b),
        ("mm", *_operand_key(b)),
        (lambda blk: torch.mm(b.t(), blk.t()).t().contiguous(),),
    )


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

    others = [operands[i] for i in range(len(operands)) if i not in blocked]
    key = ("einsum", equation, tuple(blocked), *_operand_key(*others))
    return in_row_blocks(run, *(operands[i] for i in blocked), key=key)


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
        key = (str(op), tuple(dims) if isinstance(dims, list | tuple) else dims, keepdim, dtype)
        return in_row_blocks(lambda b: op(b, dims, keepdim, dtype=dtype), x, key=key)

    return run


def _softmax(op):
    def run(x, dim, half_to_float):
        if not _keeps_rows(x, dim):
            return NotImplemented
        return in_row_blocks(lambda b: op(b, dim, half_to_float), x, key=(str(op), dim))

    return run


def _topk(x, k, dim=-1, largest=True, sorted=True):
    """Top-k along a dim other than the rows, on the GPU: which of two equal values comes first
    (the routing's slot order, hence the order its experts are summed in) is the algorithm's,
    and CUDA's topk picks its algorithm by shape. Blocked, every call has one shape; the values
    are gathered back from the indices (exact)."""
    if not x.is_cuda or not _keeps_rows(x, dim):
        return NotImplemented
    key = ("topk", k, dim, largest, sorted)
    idx = in_row_blocks(lambda b: aten.topk.default(b, k, dim, largest, sorted)[1], x, key=key)
    return x.gather(dim, idx), idx


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
        # A CUDA elementwise kernel applies one function to every element, vector loads or not.
        if not x.is_floating_point() or x.numel() == 0 or x.is_cuda:
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
    aten.topk.default: _topk,
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


def check_supported(cfg, device: torch.device | str, family: str = "llama") -> None:
    """Refuse, at startup, what `--deterministic` cannot make invariant yet (never run the
    non-invariant path silently). `family`: the model family's registry name."""
    if not cfg.deterministic:
        return
    if cfg.tensor_parallel_size > 1:
        raise ValueError(
            "--deterministic with tensor parallel is not supported yet: an all-reduce sums a "
            "row in an order that follows the message size, hence the batch"
        )
    if torch.device(device).type != "cpu":
        if family not in ("llama", "deepseek_v4"):
            raise ValueError(
                f"--deterministic on the GPU covers the llama and deepseek_v4 families, not "
                f"{family} (--device cpu runs it)"
            )
        if cfg.attention_backend not in ("auto", "triton"):
            raise ValueError(
                f"--deterministic on the GPU runs the Triton path, not the {cfg.attention_backend!r}"
                " attention backend (its torch ops are made invariant on the CPU only)"
            )
        if cfg.linear_weights == "fp8":
            raise ValueError(
                "--deterministic on the GPU with --linear-weights fp8 is not supported yet: the "
                "FP8 linear kernel picks its tiles and split over K from the row count"
            )
        return
    if cfg.attention_backend in ("triton", "reference"):
        raise ValueError(
            f"--deterministic needs the torch attention backend, not {cfg.attention_backend!r} "
            "(the reference path attends per sequence with widths that follow the chunking)"
        )
