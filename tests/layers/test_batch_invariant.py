"""Batch-invariant ops (`--deterministic`): a row's result alone (M=1) equals, bit for bit, its
result inside batches of random sizes at random positions, in float32 and bf16; and for each op
the default path is shown to differ for some shape (so these tests can fail), except where torch
is already invariant on some CPU (said where it is). That the comparison itself sees a one-ulp
difference is shown on any CPU (`test_rows_differ_sees_one_ulp`)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvrelay.kernels import reference
from kvrelay.kernels.indexer_reference import indexer_topk_reference
from kvrelay.layers import batch_invariant_attention as bia
from kvrelay.layers.batch_invariant import scope
from kvrelay.models.deepseek_v4.sparse_attention import sparse_mqa_reference

DTYPES = [torch.float32, torch.bfloat16]


def rows_differ(f, x: torch.Tensor, on: bool, trials: int = 4, seed: int = 0) -> list:
    """(batch size, position) where f(x[batch])[position] != f(x[row])[0] for the same row."""
    rng = random.Random(seed)
    bad = []
    with scope(on), torch.inference_mode():
        for _ in range(trials):
            m = rng.randint(2, x.shape[0])
            start = rng.randint(0, x.shape[0] - m)
            pos = rng.randrange(m)
            batch = f(x[start : start + m])[pos]
            alone = f(x[start + pos : start + pos + 1])[0]
            if not torch.equal(batch, alone):
                bad.append((m, pos))
    return bad


def test_rows_differ_sees_one_ulp() -> None:
    """The check of every test here is not vacuous on any CPU: a product whose rows come out
    one ulp higher in a batch than alone is caught."""
    torch.manual_seed(0)
    w, x = torch.randn(64, 96), torch.randn(40, 96)

    def nudged(a):
        y = F.linear(a, w)
        return y if a.shape[0] == 1 else torch.nextafter(y, torch.tensor(float("inf")))

    assert rows_differ(nudged, x, on=True) and rows_differ(nudged, x, on=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows(dtype) -> None:
    torch.manual_seed(0)
    # float32: M=1 runs a GEMV, M>1 a GEMM (any shape). bf16: oneDNN's blocking follows M at
    # some shapes with AVX-512/AMX (K=4096, N=512 or 576 for some draws), at none measured with
    # AVX2 (K 64..4096, N 64..1536): not asserted
    k, n = (4096, 512) if dtype == torch.bfloat16 else (576, 256)
    w = torch.randn(n, k).to(dtype)
    x = torch.randn(40, k).to(dtype)
    if dtype == torch.float32:
        assert rows_differ(lambda a: F.linear(a, w), x, on=False, trials=8)
    assert not rows_differ(lambda a: F.linear(a, w), x, on=True)
    assert not rows_differ(lambda a: a @ w.T, x, on=True)  # aten.matmul


@pytest.mark.parametrize("n", [24, 64])
def test_linear_row_at_every_position_of_a_block(n: int) -> None:
    """A fixed-shape block is not enough by itself: MKL's AVX2 sgemm with 2 threads computes
    rows 6, 7, 14 and 15 of a [16, 256] x [256, N<=64] block in another order than the others
    (dsv4-tiny's mHC mix, N=24, broke its decode beside others' prefill). In the mode a row
    gives the same bits at every position of blocks of 16, 17 and 33 rows, on 2 threads."""
    torch.manual_seed(5)
    w, x = torch.randn(n, 256), torch.randn(1, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with scope(True), torch.inference_mode():
            alone = F.linear(x, w)[0]
            for m in (16, 17, 33):
                for p in range(m):
                    rows = torch.randn(m, 256)
                    rows[p] = x[0]
                    assert torch.equal(F.linear(rows, w)[p], alone), (m, p)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_projection_rows(dtype) -> None:
    """DeepSeek-V4's block-diagonal output projection (an einsum led by the token rows)."""
    torch.manual_seed(1)
    w = torch.randn(8, 64, 512).to(dtype)
    x = torch.randn(60, 8, 512).to(dtype)

    def f(a):
        return torch.einsum("ngi,gri->ngr", a, w)

    if dtype == torch.float32:
        assert rows_differ(f, x, on=False)
    # bf16: this machine's bmm happens to be invariant over M at these shapes
    assert not rows_differ(f, x, on=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_rows(dtype) -> None:
    """Routed experts: how many tokens reach an expert follows the batch (grouped GEMMs of
    varying M); a token's output must not."""
    from kvrelay.models.deepseek_v4.experts import Experts
    from kvrelay.weights.loader import resolve

    torch.manual_seed(2)
    cfg = resolve("dsv4-tiny", "dummy").config
    ex = Experts(cfg, dtype)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.05)
        ex.down_proj.normal_(0, 0.05)
    n, e, k = 32, cfg.n_routed_experts, cfg.num_experts_per_tok
    x = torch.randn(n, cfg.hidden_size).to(dtype)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    weights = torch.rand(n, k)
    both = torch.cat([x.float(), weights, idx.float()], dim=1)
    h = cfg.hidden_size

    def f(rows):
        return ex(rows[:, :h].to(dtype), rows[:, h : h + k], rows[:, h + k :].long())

    if dtype == torch.float32:
        assert rows_differ(f, both, on=False, trials=8)
    assert not rows_differ(f, both, on=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_softmax_rows(dtype) -> None:
    """Row reductions over the hidden dim / vocabulary. torch on this machine (2 threads,
    AVX512) is already invariant here: no failing default case to show; the mode blocks them
    anyway so that no thread split can follow the batch."""
    torch.manual_seed(3)
    x = torch.randn(40, 576).to(dtype)
    wt = torch.rand(576).to(dtype)
    assert not rows_differ(lambda a: reference.rms_norm(a, wt, 1e-5)[0], x, on=True)
    v = torch.randn(20, 49152)
    assert not rows_differ(lambda a: torch.log_softmax(a, dim=-1), v, on=True)
    assert not rows_differ(lambda a: a.softmax(-1).sum(-1), v, on=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transcendental_elementwise_rows(dtype) -> None:
    """exp / sigmoid / silu / ...: the vectorised CPU loop and its scalar tail round differently,
    so a row of a small gate (DeepSeek-V4's mHC post gate is [T, 4]) got other bits at T=1 (all
    4 elements in the tail) than at T=8 (measured in float32; it broke dsv4-tiny's decode alone
    vs beside a prefill chunk). In the mode every element runs through the vector loop."""
    torch.manual_seed(4)
    gate = (torch.randn(40, 4) * 4).to(dtype)
    if dtype == torch.float32:
        assert rows_differ(torch.sigmoid, gate, on=False, trials=64)  # ~14% of rows differ
    wide = (torch.randn(40, 300) * 4).to(dtype)  # 300 per row: a tail at most sizes
    for fn in (torch.sigmoid, torch.exp, F.silu, F.softplus, torch.tanh, torch.sin, F.gelu):
        for x in (gate, wide, wide[:, 7:207]):  # contiguous, and a strided view
            assert not rows_differ(fn, x, on=True, trials=8), fn
    with scope(True), torch.inference_mode():  # in place: the same bits, written into x
        x = wide.clone()
        x.sigmoid_()
        assert torch.equal(x, wide.sigmoid())


def _paged(seed: int, dtype, lens: list[int], page: int = 16):
    g = torch.Generator().manual_seed(seed)
    pages = sum(-(-n // page) for n in lens) + 1
    kc = torch.randn(pages, page, 3, 64, generator=g).to(dtype)
    vc = torch.randn(pages, page, 3, 64, generator=g).to(dtype)
    table = torch.zeros(len(lens), max(-(-n // page) for n in lens), dtype=torch.int32)
    nxt = 1
    for b, n in enumerate(lens):
        table[b, : -(-n // page)] = torch.arange(nxt, nxt + -(-n // page))
        nxt += -(-n // page)
    return kc, vc, table


def _attend(fn, q, kc, vc, table, lens, q_lens):
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return fn(q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), cu, 0.125)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_decode_equals_any_chunk(dtype) -> None:
    """A query row's output decoding alone equals its output inside a prefill chunk (cut at
    several places) beside other sequences."""
    lens = [150, 37, 90]
    kc, vc, table = _paged(4, dtype, lens)
    q = torch.randn(200, 9, 64, generator=torch.Generator().manual_seed(5)).to(dtype)

    def run(fn, on):
        with scope(on), torch.inference_mode():
            alone = _attend(fn, q[:1], kc, vc, table[:1], [150], [1])[0]
            outs = []
            for chunk in (1, 20, 77, 150):  # sequence 0's last chunk, with the other two
                q_lens = [chunk, 5, 1]
                rows = q[1 : 1 + sum(q_lens)].clone()
                rows[chunk - 1] = q[0]  # the token decoded alone above
                out = _attend(fn, rows, kc, vc, table, lens, q_lens)
                outs.append(torch.equal(out[chunk - 1], alone))
            return outs, alone

    got, alone = run(bia.paged_attention, True)
    assert all(got)
    want = _attend(reference.paged_attention, q[:1], kc, vc, table[:1], [150], [1])[0]
    assert torch.allclose(
        alone.float(), want.float(), atol=2e-2 if dtype != torch.float32 else 1e-5
    )
    if dtype == torch.float32:  # the reference's SDPA paths (decode, causal, masked) differ
        assert not all(run(reference.paged_attention, False)[0])


def _sparse_inputs(dtype, n=40, width=70):
    g = torch.Generator().manual_seed(6)
    kv_a = torch.randn(300, 128, generator=g).to(dtype)
    kv_b = torch.randn(100, 128, generator=g).to(dtype)
    q = torch.randn(n, 8, 128, generator=g).to(dtype)
    idx_a = torch.randint(-1, 300, (n, 128), generator=g)
    idx_b = torch.randint(0, 100, (n, width), generator=g)
    # row t sees the first few_t compressed entries; the rest is -1 (the batch's width)
    few = torch.randint(1, width, (n,), generator=g)
    idx_b = torch.where(torch.arange(width)[None, :] < few[:, None], idx_b, -1)
    sinks = torch.randn(8, generator=g)
    return q, kv_a, idx_a, kv_b, idx_b, sinks, few


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_mqa_rows_and_width(dtype) -> None:
    """DeepSeek-V4 sparse MQA with sinks: a row alone, with only as many compressed columns as
    it needs, equals the row inside the batch (whose width the widest row sets)."""
    q, kv_a, idx_a, kv_b, idx_b, sinks, few = _sparse_inputs(dtype)

    def run(fn, on):
        bad = 0
        with scope(on), torch.inference_mode():
            full = fn(q, kv_a, idx_a, kv_b, idx_b, sinks, 0.09)
            for t in range(0, q.shape[0], 3):
                w = int(few[t])
                one = fn(q[t : t + 1], kv_a, idx_a[t : t + 1], kv_b, idx_b[t : t + 1, :w],
                         sinks, 0.09)  # fmt: skip
                bad += not torch.equal(one[0], full[t])
        return bad, full

    bad, full = run(bia.sparse_mqa, True)
    assert bad == 0
    ref = sparse_mqa_reference(q, kv_a, idx_a, kv_b, idx_b, sinks, 0.09)
    assert torch.allclose(full.float(), ref.float(), atol=1e-2 if dtype != torch.float32 else 1e-5)
    if dtype == torch.float32:  # (in bf16 the reference happened to agree on these inputs)
        assert run(sparse_mqa_reference, False)[0] > 0


def test_indexer_topk_rows_and_width() -> None:
    """The indexer's chosen entries and their order: a row alone (its sequence's own entry
    count) equals the row beside a sequence with many more entries."""
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(400, 64, generator=g).to(torch.bfloat16)
    q = torch.randn(30, 4, 64, generator=g).to(torch.bfloat16)
    w = torch.rand(30, 4, generator=g)
    rows = torch.randperm(400, generator=g)[:300].view(2, 150)
    seq = torch.tensor([0] * 29 + [1])
    vis = torch.randint(1, 40, (30,), generator=g)
    vis[-1] = 150  # the other sequence sees 150 entries: the batch is 150 wide
    with scope(True), torch.inference_mode():
        full = bia.indexer_topk(q, w, keys, None, rows, seq, vis, 16)
        for t in range(29):
            one = bia.indexer_topk(
                q[t : t + 1], w[t : t + 1], keys, None, rows[:1, :40], seq[:1], vis[t : t + 1], 16
            )
            assert torch.equal(one[0], full[t])
    ref = indexer_topk_reference(q, w, keys, None, rows, seq, vis, 16)
    assert (ref == full).float().mean() > 0.9  # the same top-k up to near-ties


def test_sampler_rows() -> None:
    """Seeded sampling and logprobs of a request alone and among others: each draw comes from
    the request's own generator and each vocabulary reduction sees [1, V]. (The default sampler
    is already invariant on this machine for these shapes; the mode pins the shapes.)"""
    from kvrelay.engine.messages import SamplingParams
    from kvrelay.engine.sampler import sample

    logits = torch.randn(12, 49152, generator=torch.Generator().manual_seed(8)) * 3
    ps = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50 * i, logprobs=2) for i in range(12)]

    def gens(ids):
        return [torch.Generator().manual_seed(100 + i) for i in ids]

    full = sample(logits, ps, [[]] * 12, gens(range(12)), deterministic=True)
    for i in range(12):
        one = sample(logits[i : i + 1], [ps[i]], [[]], gens([i]), deterministic=True)
        assert one.token_ids[0] == full.token_ids[i]
        assert one.logprobs[0] == full.logprobs[i]
        assert one.top_logprobs[0] == full.top_logprobs[i]
