"""The batched indexer top-k reference (kvrelay.kernels.indexer_reference) against the model's
own Indexer.select on a dsv4-tiny indexer, plus its pool, visibility, blocking and tie rules,
and the torch.topk selection of kvrelay.kernels.triton_indexer (pure torch, runs on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.kernels import indexer_reference as ir
from kvrelay.kernels.indexer_reference import (
    indexer_scores_reference,
    indexer_topk_reference,
    select_reference,
)
from kvrelay.kernels.triton_indexer import topk_select_torch
from kvrelay.models.deepseek_v4 import preset
from kvrelay.models.deepseek_v4.compressor import QUANT_FP4
from kvrelay.models.deepseek_v4.config import CSA
from kvrelay.models.deepseek_v4.indexer import Indexer
from kvrelay.models.deepseek_v4.precision import wide
from kvrelay.models.deepseek_v4.qat import fake_quant_fp4, hadamard
from kvrelay.models.deepseek_v4.rope import RopeTable, apply_rope

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tiny_indexer(dtype: torch.dtype, gen: torch.Generator) -> Indexer:
    c = preset("dsv4-tiny")
    rope = RopeTable.for_layer(c, CSA)
    idx = Indexer(
        c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim, c.csa_compress_ratio,
        rope, c.qk_rope_head_dim, c.rms_norm_eps, c.qat_simulation, dtype,
    )  # fmt: skip
    with torch.no_grad():
        for p in idx.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    return idx


def _q_and_w(idx: Indexer, x, qr, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """q (rotated, QAT-rounded) and scaled head weights exactly as Indexer.scores makes them."""
    n, h, d = x.shape[0], idx.n_heads, idx.dim
    cos, sin = idx.rope.cos_sin(positions, x.dtype)
    q = apply_rope(idx.q_b_proj(qr).view(n, h, d), cos, sin)
    if idx.quant == QUANT_FP4:
        q = fake_quant_fp4(hadamard(q), 32)
    xw = wide(x)
    w = F.linear(xw, idx.scorer.weights_proj.weight.to(xw.dtype)) * (d**-0.5 * h**-0.5)
    return q, w


def _pad(idx: torch.Tensor, k: int) -> torch.Tensor:
    return F.pad(idx, (0, k - idx.shape[1]), value=-1)


def _assert_sets_near(got, ref, scores, tol=1e-5) -> None:
    """Equal sets, except entries within rounding of the row's K-th score (fp32 sums in
    different orders)."""
    for t in range(got.shape[0]):
        a, r = set(got[t].tolist()) - {-1}, set(ref[t].tolist()) - {-1}
        if a == r:
            continue
        kth = scores[t, ref[t][ref[t] >= 0]].min()
        diff = torch.tensor(sorted(a ^ r))
        scale = scores[t][torch.isfinite(scores[t])].abs().max()
        assert len(a) == len(r) and (scores[t, diff] - kth).abs().max() <= tol * scale


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_matches_indexer_select_on_dsv4_tiny(dtype):
    """Two sequences in one batch, keys in a shuffled pool: a 37-token prefill from position 0
    and 5 decode-ish tokens late in a 200-token context, against Indexer.select per sequence."""
    gen = torch.Generator().manual_seed(0)
    idx = _tiny_indexer(dtype, gen)
    c = preset("dsv4-tiny")
    topk, ratio = c.index_topk, c.csa_compress_ratio
    seqs = [torch.arange(37), torch.arange(195, 200)]
    n_entries = [int(p[-1] + 1) // ratio for p in seqs]  # 9 and 50 entries
    n_cols = max(n_entries) + 3
    pool = torch.randn(sum(n_entries) + 6, c.index_head_dim, generator=gen).to(dtype)
    perm = torch.randperm(pool.shape[0], generator=gen)
    key_rows = torch.full((2, n_cols), -1, dtype=torch.int64)
    qs, ws, expect, first = [], [], [], 0
    for b, (pos, n) in enumerate(zip(seqs, n_entries, strict=True)):
        key_rows[b, :n] = perm[first : first + n]
        first += n
        x = torch.randn(len(pos), c.hidden_size, generator=gen).to(dtype)
        qr = torch.randn(len(pos), c.q_lora_rank, generator=gen).to(dtype)
        with torch.no_grad():
            q, w = _q_and_w(idx, x, qr, pos)
            expect.append(_pad(idx.select(x, qr, pos, pool[key_rows[b, :n]], topk), topk))
        qs.append(q)
        ws.append(w)
    seq_of_token = torch.cat([torch.full((len(p),), b) for b, p in enumerate(seqs)])
    n_visible = torch.cat([(p + 1) // ratio for p in seqs])
    q, w = torch.cat(qs), torch.cat(ws)
    args = (q, w, pool, None, key_rows, seq_of_token, n_visible)
    got = indexer_topk_reference(*args, topk)
    expect = torch.cat(expect)
    assert got.shape == (q.shape[0], topk)
    assert bool((got[0] == -1).all())  # position 0 sees no entry yet
    if dtype == torch.float64:
        assert torch.equal(got, expect)
    else:
        _assert_sets_near(got, expect, indexer_scores_reference(*args))


def test_fp8_keys_read_as_the_pool_reads_them():
    """fp8 keys with a row scale score as (k.float() * scale).to(q.dtype), the pool's read."""
    gen = torch.Generator().manual_seed(1)
    m, d, h, t = 30, 32, 4, 6
    k = torch.randn(m, d, generator=gen)
    scale = k.abs().amax(dim=1) / 448.0
    k8 = (k / scale[:, None]).to(torch.float8_e4m3fn)
    q = torch.randn(t, h, d, generator=gen).to(torch.bfloat16)
    w = torch.randn(t, h, generator=gen)
    rows = torch.randperm(m, generator=gen)[:24].view(2, 12)
    seq = torch.tensor([0, 0, 0, 1, 1, 1])
    n_vis = torch.tensor([12, 5, 0, 12, 11, 3])
    deq = (k8.float() * scale[:, None]).to(torch.bfloat16)
    a = indexer_scores_reference(q, w, k8, scale, rows, seq, n_vis)
    b = indexer_scores_reference(q, w, deq, None, rows, seq, n_vis)
    assert torch.equal(a, b)
    assert torch.equal(
        indexer_topk_reference(q, w, k8, scale, rows, seq, n_vis, 4),
        indexer_topk_reference(q, w, deq, None, rows, seq, n_vis, 4),
    )


def test_visibility_ties_and_padding_columns():
    """Scores all 0.0 (q <= 0, keys >= 0): the lowest visible entries win; -1 pads rows with
    fewer than K visible; -1 pool rows past a sequence's entries are never an issue."""
    t, h, d = 5, 3, 16
    q = -torch.rand(t, h, d)
    keys = torch.rand(10, d)
    rows = torch.tensor([[3, 1, 4, 0, 9, -1, -1], [2, 5, 6, 7, 8, -1, -1]])
    seq = torch.tensor([0, 0, 1, 1, 1])
    n_vis = torch.tensor([5, 2, 0, 4, 7])
    w = torch.rand(t, h)
    got = indexer_topk_reference(q, w, keys, None, rows, seq, n_vis, 3)
    assert got.tolist() == [[0, 1, 2], [0, 1, -1], [-1, -1, -1], [0, 1, 2], [0, 1, 2]]
    # topk > N: K = N columns.
    assert indexer_topk_reference(q, w, keys, None, rows, seq, n_vis, 50).shape == (t, 7)


def test_blocks_do_not_change_the_result(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    t, h, d, n = 23, 4, 16, 40
    q, w = torch.randn(t, h, d, generator=gen), torch.randn(t, h, generator=gen)
    keys = torch.randn(100, d, generator=gen)
    rows = torch.randperm(100, generator=gen)[:80].view(2, n)
    seq = torch.randint(0, 2, (t,), generator=gen)
    n_vis = torch.randint(0, n + 1, (t,), generator=gen)
    whole = indexer_topk_reference(q, w, keys, None, rows, seq, n_vis, 8)
    monkeypatch.setattr(ir, "_BLOCK_ELEMS", n * d * 3)  # 3 rows per block
    assert ir.rows_per_block(n, h, d) == 3
    assert torch.equal(indexer_topk_reference(q, w, keys, None, rows, seq, n_vis, 8), whole)


def test_topk_select_torch_matches_the_stable_sort_rule():
    """The packed-key torch.topk selection gives the reference's exact order on crafted rows:
    ties, +-0.0, NaN of both signs (above +inf), +-inf, garbage past n_visible."""
    gen = torch.Generator().manual_seed(3)
    neg_nan = torch.tensor([-4194304], dtype=torch.int32).view(torch.float32)
    vals = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")])
    vals = torch.cat([vals, neg_nan])
    t, n, topk = 12, 300, 40
    pick = torch.randint(0, len(vals) + 3, (t, n), generator=gen)
    rnd = torch.randn(t, n, generator=gen).round(decimals=1)
    s = torch.where(pick < len(vals), vals[pick.clamp(max=len(vals) - 1)], rnd)
    s[0] = 0.0
    s[1] = torch.where(torch.arange(n) % 2 == 0, -0.0, 0.0)
    n_vis = torch.randint(0, n + 1, (t,), generator=gen)
    n_vis[:4] = torch.tensor([n, n, 0, topk - 1])
    cols = torch.arange(n)[None, :]
    ref = select_reference(s.masked_fill(cols >= n_vis[:, None], float("-inf")), topk)
    junk = torch.where(cols >= n_vis[:, None], float("nan"), s)
    assert torch.equal(topk_select_torch(junk, n_vis, topk), ref)
    assert ref[0].tolist() == list(range(topk))
    assert ref[1].tolist() == list(range(topk))
