"""The Triton sparse MQA kernel (DeepSeek-V4 attention with sinks) on the GPU against the
float64 torch reference over the concatenated sources.

Quick tier (`pytest -m gpu`): the default configs at CSA decode (bf16, 64 heads x 512), the tiny
model (fp32; bf16 without a second source), int64 indices with dominant sinks, unaligned pool
rows, empty rows and graph replay. gpu_full (`pytest -m gpu_full`): the other shape x dtype
cases, forced split counts, every tile config (DV_SPLIT, BLOCK_N, stages) and index-dtype mix."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiered

from kvrelay.kernels.triton_sparse_attention import sparse_mqa
from kvrelay.models.deepseek_v4.sparse_attention import sparse_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Relative error ||out - ref|| / ||ref|| against float64. fp32 dots run as "ieee".
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
PAGE = 64  # rows per page of the pools (the kernel only sees the flattened rows)
_SEEDS = itertools.count(1)

# (T, H, D, Ka, Kb): the tiny model, sliding-only layers (Kb = 0 or no source b), CSA decode,
# HCA at long context, a prefill chunk.
SHAPES = [
    (1, 4, 96, 16, 8),
    (5, 4, 96, 16, 0),
    (5, 4, 96, 16, None),
    (64, 64, 512, 128, 512),
    (3, 64, 512, 128, 2048),
    (300, 64, 512, 128, 512),
]
IDS = ["tiny", "tiny-kb0", "tiny-sliding", "csa-decode64", "hca-long", "prefill300"]


def _pool(rows: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """[rows, d] rows of a paged pool: a flattened view of [pages, PAGE, d + 32] whose 32
    padding columns and spare last-page rows hold NaN (any stray read poisons the output)."""
    pages = -(-rows // PAGE)
    base = torch.full((pages, PAGE, d + 32), float("nan"), dtype=dtype, device="cuda")
    flat = base.view(pages * PAGE, d + 32)
    flat[:rows, :d] = torch.randn(rows, d, generator=gen, device="cuda").to(dtype)
    return base[:, :, :d].reshape(pages * PAGE, d)[:rows]  # a view: row stride d + 32


def _indices(t: int, k: int, rows: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Random rows with -1 holes, one row with no entry, repeated entries."""
    idx = torch.randint(0, rows, (t, k), generator=gen, device="cuda")
    holes = torch.rand(t, k, generator=gen, device="cuda") < 0.25
    idx = torch.where(holes, -1, idx)
    if k:
        if t > 1:
            idx[t // 2] = -1  # mixed with full rows: this row lists nothing in this source
        if k > 3:
            idx[:, 3] = idx[:, 2]  # the same entry twice counts twice
        idx[0, : k // 2] = -1  # a row whose first half is empty
    return idx.to(dtype)


def _inputs(t, h, d, ka, kb, dtype, idx_dtype=torch.int32, big_sinks=False):
    gen = torch.Generator(device="cuda").manual_seed(next(_SEEDS))
    q = torch.randn(t, h, d, generator=gen, device="cuda").mul(2.0).to(dtype)
    ma = max(4 * ka, 1) + 7
    kv_a, idx_a = _pool(ma, d, dtype, gen), _indices(t, ka, ma, gen, idx_dtype)
    if kb is None:
        kv_b = idx_b = None
    else:
        mb = max(3 * kb, 1) + 5
        kv_b, idx_b = _pool(mb, d, dtype, gen), _indices(t, kb, mb, gen, idx_dtype)
    sinks = torch.randn(h, generator=gen, device="cuda") * 2.0
    sinks[::4] += 12.0 if big_sinks else 6.0  # heads whose sink takes (nearly) all the mass
    return q, kv_a, idx_a, kv_b, idx_b, sinks


def _reference(q, kv_a, idx_a, kv_b, idx_b, sinks, scale) -> torch.Tensor:
    if kv_b is None:
        kv, idx = kv_a, idx_a.long()
    else:
        shifted = torch.where(idx_b >= 0, idx_b.long() + kv_a.shape[0], -1)
        kv, idx = torch.cat((kv_a, kv_b)), torch.cat((idx_a.long(), shifted), 1)
    return sparse_attention(q.double(), kv.double(), idx, sinks.double(), scale)


def _run(args: tuple, scale: float, **kwargs) -> torch.Tensor:
    """sparse_mqa into an output poisoned with NaN (every element must be written)."""
    out = torch.full_like(args[0], float("nan"))
    assert sparse_mqa(*args, scale, out=out, **kwargs) is out
    return out


def _check(out: torch.Tensor, args: tuple, scale: float, dtype: torch.dtype) -> None:
    q, kv_a, idx_a, kv_b, idx_b, sinks = args
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all(), "NaN/inf in the output (unwritten or a stray read)"
    ref = _reference(q, kv_a, idx_a, kv_b, idx_b, sinks, scale)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < TOL[dtype], f"relative error {rel:.2e}"
    # A row without any entry gives exactly 0 (the sink takes all the mass).
    empty = (idx_a < 0).all(1) & (True if idx_b is None else (idx_b < 0).all(1))
    assert empty.any() == (q.shape[0] > 1)
    assert (out[empty] == 0).all()


@tiered(
    "shape,dtype",
    [(shape, dtype) for dtype in (torch.float32, torch.bfloat16) for shape in SHAPES],
    quick=["csa-decode64-bf16", "tiny-fp32", "tiny-sliding-bf16"],
    ids=lambda c: f"{IDS[SHAPES.index(c[0])]}-{'fp32' if c[1] == torch.float32 else 'bf16'}",
)
def test_matches_reference(shape, dtype):
    t, h, d, ka, kb = shape
    args = _inputs(t, h, d, ka, kb, dtype)
    scale = d**-0.5
    _check(_run(args, scale), args, scale, dtype)


@pytest.mark.gpu_full
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forced_splits(num_splits, dtype):
    """Any split count (chunks straddling the a/b boundary, more splits than tiles) agrees."""
    t, h, d, ka, kb = 4, 64, 512, 100, 300  # Ka not a multiple of the tile
    args = _inputs(t, h, d, ka, kb, dtype)
    scale = d**-0.5
    _check(_run(args, scale, num_splits=num_splits), args, scale, dtype)


# Tile configs the benchmark sweeps besides the default (see _split_config).
CONFIGS = [
    {"DV_SPLIT": 2, "num_warps": 4},
    {"DV_SPLIT": 2, "num_warps": 4, "BLOCK_N": 16},
    {"DV_SPLIT": 2, "num_warps": 4, "BLOCK_N": 64, "num_stages": 2},
    {"BLOCK_N": 64},
    {"BLOCK_N": 16, "num_stages": 2},
]
CONFIG_IDS = ["dv2", "dv2-n16", "dv2-n64", "n64", "n16-st2"]


@pytest.mark.gpu_full
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize(
    "shape", [(64, 64, 512, 128, 512), (300, 64, 512, 128, 512), (5, 4, 96, 16, 8)],
    ids=["csa-decode64", "prefill300", "tiny"],
)  # fmt: skip
def test_tile_configs(shape, config):
    t, h, d, ka, kb = shape
    args = _inputs(t, h, d, ka, kb, torch.bfloat16)
    _check(_run(args, d**-0.5, config=config), args, d**-0.5, torch.bfloat16)


@pytest.mark.gpu_full
def test_dv_split_fp32():
    args = _inputs(6, 64, 512, 100, 300, torch.float32)
    out = _run(args, 512**-0.5, num_splits=3, config={"DV_SPLIT": 2})
    _check(out, args, 512**-0.5, torch.float32)


@tiered("idx_dtype", [torch.int32, torch.int64], quick=["i64"], ids=["i32", "i64"])
def test_index_dtypes_and_dominant_sinks(idx_dtype):
    args = _inputs(8, 64, 512, 128, 256, torch.bfloat16, idx_dtype, big_sinks=True)
    _check(_run(args, 512**-0.5), args, 512**-0.5, torch.bfloat16)


@pytest.mark.gpu_full
def test_mixed_index_dtypes_and_contiguous_pools():
    q, kv_a, idx_a, kv_b, idx_b, sinks = _inputs(6, 4, 96, 16, 40, torch.float32)
    args = (q, kv_a.contiguous(), idx_a.long(), kv_b.contiguous(), idx_b.int(), sinks)
    _check(_run(args, 0.1), args, 0.1, torch.float32)


def test_unaligned_pool_rows():
    """A pool whose rows are not 16-byte aligned (odd row stride) still reads correctly."""
    gen = torch.Generator(device="cuda").manual_seed(next(_SEEDS))
    q, _, idx_a, kv_b, idx_b, sinks = _inputs(3, 4, 96, 16, 8, torch.bfloat16)
    base = torch.randn(idx_a.max().item() + 1, 97, generator=gen, device="cuda")
    kv_a = base.to(torch.bfloat16)[:, 1:]  # row stride 97 elements, start 2 bytes in
    args = (q, kv_a, idx_a, kv_b, idx_b, sinks)
    _check(_run(args, 0.1), args, 0.1, torch.bfloat16)


def test_all_empty_and_zero_rows():
    q, kv_a, idx_a, kv_b, idx_b, sinks = _inputs(5, 4, 96, 16, 8, torch.bfloat16)
    empty = (q, kv_a, torch.full_like(idx_a, -1), kv_b, torch.full_like(idx_b, -1), sinks)
    for splits in (None, 1, 3):
        assert (_run(empty, 0.1, num_splits=splits) == 0).all()
    assert sparse_mqa(q[:0], kv_a, idx_a[:0], kv_b, idx_b[:0], sinks, 0.1).shape == (0, 4, 96)


@tiered(
    "shape,config",
    [((1, 64, 512, 128, 512), None), ((64, 64, 512, 128, 512), None),
     ((5, 4, 96, 16, None), None), ((64, 64, 512, 128, 512), {"DV_SPLIT": 2, "num_warps": 4})],
    quick=["t1", "t64"],
    ids=["t1", "t64", "tiny-sliding", "t64-dv2"],
)  # fmt: skip
def test_cuda_graph_replay(shape, config):
    """Captured once, replayed on new contents copied into the static inputs."""
    t, h, d, ka, kb = shape
    scale = d**-0.5
    static = _inputs(t, h, d, ka, kb, torch.bfloat16)
    out = torch.full_like(static[0], float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sparse_mqa(*static, scale, out=out, config=config)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mqa(*static, scale, out=out, config=config)
    for _ in range(3):
        fresh = _inputs(t, h, d, ka, kb, torch.bfloat16)
        for dst, src in zip(static, fresh, strict=True):
            if dst is not None:
                dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, static, scale, torch.bfloat16)
