"""DeepSeek-V4's kernels as `--deterministic` runs them on the GPU (runnable.py
`_pick_ops`, deterministic): a watched row gives the same bits alone as at a random place among
1..255 random neighbours (batches of 2, 17, 64 and 256 rows, whatever the neighbours bring: more
entries, other experts, a longer step), and a graph replay of the largest batch gives the eager
bits. One check per kernel, so that an engine-level difference (test_deterministic_gpu.py) points
at its cause. The default schedules beside them are reported (how many batches moved the row),
not asserted: whether they vary is theirs to choose."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_triton_mhc import _inputs as mhc_inputs
from test_triton_mhc import _modules as mhc_modules
from test_triton_moe import _experts, _routing

from kvrelay.kernels.triton_indexer import indexer_topk
from kvrelay.kernels.triton_mhc import PRE_MAX_TOKENS, hc_pre
from kvrelay.kernels.triton_moe import INVARIANT_CONFIG, fused_experts
from kvrelay.kernels.triton_sparse_attention import sparse_mqa
from kvrelay.layers import batch_invariant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SIZES = (2, 17, 64, 256)
POOL = 300  # rows to draw neighbours from; row 0 is the watched one

Run = Callable[[torch.Tensor], torch.Tensor]  # rows of the pool -> the kernel's output rows


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _batches(seed: int, sizes=SIZES, pool: int = POOL):
    """(rows, place of row 0) per size: row 0 among n - 1 random others at a random place."""
    g = torch.Generator().manual_seed(seed)
    for n in sizes:
        others = torch.randperm(pool - 1, generator=g)[: n - 1] + 1
        at = int(torch.randint(0, n, (1,), generator=g))
        yield torch.cat([others[:at], torch.zeros(1, dtype=torch.long), others[at:]]).cuda(), at


def _graphed(run: Run, rows: torch.Tensor) -> torch.Tensor:
    """run(rows) captured in a CUDA graph (after one eager call) and replayed."""
    run(rows)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(rows)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def assert_row_invariant(
    run: Run, default: Run | None = None, sizes=SIZES, pool: int = POOL, seed: int = 0
) -> None:
    one = torch.zeros(1, dtype=torch.long, device="cuda")
    alone = run(one)[0]
    default_alone = None if default is None else default(one)[0]
    moved = 0
    for rows, at in _batches(seed, sizes, pool):
        assert torch.equal(run(rows)[at], alone), f"row moved among {rows.numel()}"
        if default is not None:
            moved += not torch.equal(default(rows)[at], default_alone)
    rows, at = next(_batches(seed + 1, sizes[-1:], pool))
    assert torch.equal(_graphed(run, rows)[at], alone), "graph replay"
    if default is not None:
        print(f"default schedule: the row moved in {moved} of {len(sizes)} batches")


def _width(lengths: torch.Tensor, rows: torch.Tensor) -> int | None:
    """Columns a batch lists: its longest row's (eagerly, as a step's batch does), or all of them
    inside a capture (no host read there; as a graph's context bucket does)."""
    if torch.cuda.is_current_stream_capturing():
        return None
    return int(lengths[rows].max())


def test_sparse_mqa_in_one_split() -> None:
    """64 heads over a window of 128 rows (17 not yet filled) and up to 900 compressed entries
    per row: a batch lists as many as its longest row (-1 after each row's own), a row alone
    only its own. One split per row; the default split count follows the row count."""
    g = _gen(1)
    h, d, ka, kb = 64, 512, 128, 900
    q = torch.randn(POOL, h, d, generator=g, device="cuda").to(torch.bfloat16)
    kv_a = torch.randn(4096, d, generator=g, device="cuda").to(torch.bfloat16)
    kv_b = torch.randn(2048, d, generator=g, device="cuda").to(torch.bfloat16)
    idx_a = torch.randint(0, 4096, (POOL, ka), generator=g, device="cuda", dtype=torch.int32)
    idx_a[:, :17] = -1
    own = torch.randint(1, kb, (POOL,), generator=g, device="cuda")
    idx_b = torch.randint(0, 2048, (POOL, kb), generator=g, device="cuda", dtype=torch.int32)
    idx_b = torch.where(torch.arange(kb, device="cuda")[None, :] < own[:, None], idx_b, -1)
    sinks = torch.randn(h, generator=g, device="cuda")

    def run(rows: torch.Tensor, splits: int | None = 1) -> torch.Tensor:
        b = idx_b[rows, : _width(own, rows)].contiguous()
        return sparse_mqa(q[rows], kv_a, idx_a[rows], kv_b, b, sinks, d**-0.5, num_splits=splits)

    assert_row_invariant(run, lambda rows: run(rows, None))


@pytest.mark.parametrize("fp4", [True, False], ids=["nvfp4", "dense"])
def test_fused_moe_at_the_invariant_config(fp4: bool) -> None:
    """Tokens routed top-6 of 32 experts at random: the watched token's experts' blocks hold
    other rows at other places in every batch. One config; `default_config` follows the
    tokens per expert."""
    g = _gen(2)
    ex = _experts(32, 512, 256, fp4, torch.bfloat16, g)
    x = torch.randn(POOL, 512, generator=g, device="cuda").to(torch.bfloat16)
    w, idx = _routing(POOL, 32, 6, "topk", g)

    def run(rows: torch.Tensor, config=INVARIANT_CONFIG) -> torch.Tensor:
        return fused_experts(x[rows], w[rows], idx[rows], ex, config)

    assert_row_invariant(run, lambda rows: run(rows, None))


def test_hc_pre_past_its_default_limit() -> None:
    """The mHC pre kernel serves every step size in the mode, also past PRE_MAX_TOKENS (where the
    default path hands long steps to the gates kernel): batches of up to 600 tokens."""
    pool = PRE_MAX_TOKENS + 100
    hc, norm = mhc_modules(1024)
    streams, pending = mhc_inputs(pool, 1024, torch.bfloat16, 3)

    def run(rows: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = hc.pre_fused(hc_pre, streams[rows], tuple(p[rows] for p in pending), norm)
        # merged streams, normed input, post, comb: one row each, side by side
        return torch.cat([o.reshape(rows.numel(), -1).float() for o in out], dim=1)

    assert_row_invariant(run, sizes=(2, 64, 256, PRE_MAX_TOKENS + 88), pool=pool)


def test_indexer_top_k() -> None:
    """Query rows of other sequences whose key lists are longer (a batch's widest row sets the
    columns): the watched row's chosen entries (ascending entry order, -1 after) are the same."""
    g = _gen(4)
    h, d, n, topk = 16, 128, 700, 64
    q = torch.randn(POOL, h, d, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(POOL, h, generator=g, device="cuda") * (d**-0.5 * h**-0.5)
    keys = torch.randn(4000, d, generator=g, device="cuda").to(torch.bfloat16)
    key_rows = torch.randint(0, 4000, (POOL, n), generator=g, device="cuda")
    vis = torch.randint(1, n, (POOL,), generator=g, device="cuda")
    vis[0] = 300  # the watched row chooses 64 of 300

    def run(rows: torch.Tensor) -> torch.Tensor:
        seq = torch.arange(rows.numel(), device="cuda")
        cols = key_rows[rows, : _width(vis, rows)]
        return indexer_topk(q[rows], w[rows], keys, None, cols, seq, vis[rows], topk)

    assert_row_invariant(run)


@pytest.mark.parametrize("op", ["sum", "mean", "softmax", "topk", "einsum", "linear"])
def test_the_dispatch_mode_on_cuda(op: str) -> None:
    """The eager glue's reductions, top-k and products under the mode on CUDA tensors (a stream
    sum, an RMS, a Sinkhorn softmax, the routing's top-k of sigmoid scores, the grouped output
    projection, a linear): blocked to fixed shapes, the linears through the invariant kernel."""
    g = _gen(5)
    x = torch.randn(POOL, 4, 256, generator=g, device="cuda")
    wt = torch.randn(4, 3, 256, generator=g, device="cuda")
    lin = torch.randn(512, 1024, generator=g, device="cuda").to(torch.bfloat16)
    fns = {
        "sum": lambda a: a.sum(dim=1),
        "mean": lambda a: a.square().mean(-1),
        "softmax": lambda a: a.softmax(dim=-1),
        "topk": lambda a: a.flatten(1).sigmoid().topk(6, dim=-1).indices,
        "einsum": lambda a: torch.einsum("ngi,gri->ngr", a, wt),
        "linear": lambda a: torch.nn.functional.linear(a.flatten(1).to(torch.bfloat16), lin),
    }
    fn = fns[op]

    def run(rows: torch.Tensor) -> torch.Tensor:
        with batch_invariant.scope(True):
            return fn(x[rows])

    run(torch.arange(16, device="cuda"))  # the probe of each key, before any capture
    assert_row_invariant(run, lambda rows: fn(x[rows]))
