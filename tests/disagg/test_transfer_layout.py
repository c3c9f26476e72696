"""The cache layout a PD transfer moves: every runner describes its caches as named kinds, the
fingerprint covers them all (names, shapes, dtypes, page size) and ignores only the pool sizes."""

from __future__ import annotations

import pytest
import torch

from kvrelay.cache.host_gate import page_tensors
from kvrelay.config import CacheConfig, EngineConfig
from kvrelay.disagg.agent import cache_layout
from kvrelay.disagg.layout import PAGE, SLOT, CacheKind, fingerprint, layout_difference
from kvrelay.engine.engine import Engine
from kvrelay.engine.pd_sides import RunnerWorkerSide

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend


def engine_layout(engine: Engine) -> tuple[list[CacheKind], list[str]]:
    return cache_layout(RunnerWorkerSide(engine))


def _engine(model: str, **cache) -> Engine:
    cache.setdefault("max_total_tokens", 1024)
    dtype = cache.pop("dtype", "float32")
    cfg = EngineConfig(
        model=model, load_format="dummy", device="cpu", dtype=dtype, cache=CacheConfig(**cache)
    )
    return Engine(cfg)


def _fp(engine: Engine) -> str:
    return fingerprint(engine_layout(engine)[1])


@pytest.fixture(scope="module")
def dense() -> Engine:
    return _engine("qwen3-tiny", page_size=16)


@pytest.fixture(scope="module")
def dsv4() -> Engine:
    return _engine("dsv4-tiny")


def test_dense_layout_is_k_and_v_per_layer_viewing_the_pool(dense):
    kinds = dense.runner.transfer_layout()
    c = dense.src.config
    assert [k.name for k in kinds[:4]] == ["L0.k", "L0.v", "L1.k", "L1.v"]
    assert len(kinds) == 2 * c.num_layers
    assert all(k.unit == PAGE and k.ratio == 1 and not k.keep_last for k in kinds)
    assert kinds[0].row_shape == (c.num_kv_heads, c.head_dim)
    kinds[3].byte_rows[5].fill_(0xFF)  # a view: bytes written land in the pool
    page, off = divmod(5, dense.runner.page_size)
    assert torch.isnan(dense.runner.kv.layers[1][1][page, off]).all()
    kinds[3].byte_rows[5].fill_(0)


def test_dense_fingerprint_ignores_pool_size_but_not_shape_dtype_or_page_size(dense):
    assert _fp(_engine("qwen3-tiny", page_size=16, max_total_tokens=4096)) == _fp(dense)
    other_page = _engine("qwen3-tiny", page_size=32)
    assert _fp(other_page) != _fp(dense)
    why = layout_difference(engine_layout(dense)[1], engine_layout(other_page)[1])
    assert "page_size=16" in why and "page_size=32" in why
    bf16 = engine_layout(_engine("qwen3-tiny", page_size=16, dtype="bfloat16"))[1]
    assert "L0.k" in layout_difference(engine_layout(dense)[1], bf16)


def test_dsv4_layout_names_every_pool_tensor_once(dsv4):
    kinds = {k.name: k for k in dsv4.runner.transfer_layout()}
    pool = dsv4.runner.cache
    assert kinds.keys() == pool.kinds.keys()
    assert all(  # the pool's own tensors (a per-page value: viewed as one row per page)
        kinds[n].tensor.data_ptr() == t.data_ptr() and kinds[n].tensor.numel() == t.numel()
        for n, t in pool.kinds.items()
    )
    # Everything a page is made of travels (what a prefix hit on decode reads of a received
    # page): the host tier's walk over the pool's own tensors finds no other per-page tensor.
    per_page = {t.data_ptr() for t in page_tensors(pool).values()}
    assert per_page == {k.tensor.data_ptr() for k in kinds.values() if k.unit == PAGE}
    page_end = kinds["L1.c4_index_state.page_prev_kv"]
    assert page_end.unit == PAGE and page_end.ratio == page_end.keep_last == dsv4.runner.page_size
    assert page_end.tensor.shape[1] == 1 and "L2.c16_state.page_prev_kv" not in kinds
    assert kinds["L0.swa_kv"].keep_last == pool.cfg.sliding_window - 1
    assert (kinds["L1.c4_kv"].ratio, kinds["L1.c4_index_k"].ratio) == (4, 4)
    assert kinds["L2.c16_kv"].ratio == 16 and kinds["L2.c16_kv"].tensor.shape[1] == 1
    slots = {n for n, k in kinds.items() if k.unit == SLOT}
    assert "L1.c4_state.prev_kv" in slots and "L1.c4_index_state.pending_score" in slots
    assert "L2.c16_state.pending_kv" in slots and "L2.c16_state.prev_kv" not in slots
    assert all(k.tensor.shape[0] == pool.num_slots for n, k in kinds.items() if n in slots)


def test_dsv4_fp8_index_keys_change_the_fingerprint(dsv4):
    fp8 = _engine("dsv4-tiny", index_k_dtype="fp8")
    assert "L1.c4_index_k_scale" in {k.name for k in fp8.runner.transfer_layout()}
    assert _fp(fp8) != _fp(dsv4) != _fp(_engine("qwen3-tiny", page_size=16))
    why = layout_difference(engine_layout(dsv4)[1], engine_layout(fp8)[1])
    assert "L1.c4_index_k" in why and "float8" in why


@pytest.mark.parametrize(
    "ratio, keep_last, start, end, n, rows",
    [
        (1, 0, 0, 22, 150, (0, 22)),
        (4, 0, 0, 22, 150, (0, 5)),  # entry 5 (tokens 20-23) is not complete at token 22
        (4, 0, 22, 44, 150, (5, 11)),  # ...it goes with the next chunk
        (4, 0, 132, 150, 150, (33, 37)),  # tokens 148, 149 stay in the compressor state
        (16, 0, 0, 22, 150, (0, 1)),
        (16, 0, 22, 44, 150, (1, 2)),
        (1, 15, 0, 22, 150, (135, 135)),  # out of the final window: nothing to send
        (1, 15, 132, 150, 150, (135, 150)),
        (1, 15, 0, 10, 10, (0, 10)),
        (16, 0, 0, 150, 150, (0, 9)),  # a per-page value: final once its page is
    ],
)
def test_row_range(ratio, keep_last, start, end, n, rows):
    t = torch.zeros(4, 16 // ratio, 2)
    kind = CacheKind("x", t, PAGE, 0, ratio=ratio, keep_last=keep_last)
    assert kind.row_range(start, end, n) == rows
    if not keep_last:
        assert kind.row_range(start, end, n, resume_rows=True) == rows


@pytest.mark.parametrize(
    "ratio, keep_last, start, end, n, rows",
    [
        (1, 15, 0, 150, 150, (129, 150)),  # + 6 rows: a hit at 144 reads back to 129
        (1, 15, 0, 22, 150, (129, 129)),  # an early chunk: still nothing
        (1, 15, 132, 150, 150, (132, 150)),
        (1, 15, 0, 144, 144, (129, 144)),  # ends on a boundary: what decode reads anyway
        (1, 15, 0, 20, 20, (1, 20)),  # a hit at 16 reads back to 1, decode's step to 5
        (1, 15, 0, 10, 10, (0, 10)),  # no full page: no hit can end inside it
        (1, 40, 0, 150, 150, (104, 150)),  # a window over pages: 144 - 40
        (16, 16, 0, 150, 150, (8, 9)),  # a per-page value: the last full page's
        (16, 16, 0, 40, 40, (1, 2)),
    ],
)
def test_resume_rows_sends_the_rows_a_hit_at_the_last_full_page_reads(
    ratio, keep_last, start, end, n, rows
):
    """A decode that caches the prompt's pages (`ReserveAck.resume_rows`) gets the rows of the
    keep_last tokens before the prompt's last full page boundary too (a later hit ending there
    reads them); never fewer than without the cache."""
    t = torch.zeros(4, 16 // ratio, 2)
    kind = CacheKind("x", t, PAGE, 0, ratio=ratio, keep_last=keep_last)
    assert kind.row_range(start, end, n, resume_rows=True) == rows
    old = kind.row_range(start, end, n)
    assert rows[0] <= old[0] and rows[1] - rows[0] >= old[1] - old[0]


def test_sharded_kind_describes_whole_rows_and_installs_its_heads():
    """A dense TP rank's kinds hold their KV-head shard: the layout (what prefill matches) names
    the whole row, a whole row travels, and each rank keeps its part; sending is refused."""
    from kvrelay.disagg.pieces import gather_rows, scatter

    whole = CacheKind("L0.k", torch.zeros(3, 4, 6, 2), PAGE, 0)  # 6 kv heads of dim 2
    shards = [CacheKind("L0.k", torch.zeros(3, 4, 3, 2), PAGE, 0, shard=(r, 2)) for r in (0, 1)]
    assert all(s.describe() == whole.describe() for s in shards)
    assert shards[0].row_bytes == whole.row_bytes
    rows = torch.tensor([5, 6])  # page 1, slots 1 and 2
    payload = torch.arange(2 * 12, dtype=torch.float32).view(torch.uint8)
    for k in (whole, *shards):
        scatter([k], [rows], payload)
    got = whole.tensor[1, 1:3]
    assert torch.equal(torch.cat([s.tensor[1, 1:3] for s in shards], dim=1), got)
    assert torch.equal(got.flatten(), torch.arange(24, dtype=torch.float32))
    with pytest.raises(ValueError, match="cannot be sent whole"):
        gather_rows(shards[:1], [rows])


def test_tp_gather_joins_every_ranks_heads_into_whole_rows():
    """A dense TP prefill's rank 0 puts each rank's part of the rows back together
    (engine/tp_gather.py): bitwise the rows a TP=1 pool holds, kind after kind."""
    from kvrelay.disagg.pieces import gather_rows, local_rows
    from kvrelay.engine.tp_gather import join

    torch.manual_seed(0)
    wholes = [CacheKind(f"L0.{n}", torch.randn(3, 4, 6, 2), PAGE, 0) for n in "kv"]
    ranks = [
        [
            CacheKind(w.name, w.tensor[:, :, 3 * r : 3 * r + 3], PAGE, 0, shard=(r, 2))
            for w in wholes
        ]
        for r in (0, 1)
    ]  # each rank's pools: its 3 of the 6 kv heads
    rows = [torch.tensor([5, 6, 9]), torch.tensor([5, 6, 9])]
    parts = [local_rows(kinds, rows) for kinds in ranks]
    assert torch.equal(join(ranks[0], rows, parts), gather_rows(wholes, rows))
