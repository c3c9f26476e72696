"""The torch paged-attention reference against a naive float64 dense causal attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvrelay.kernels.reference import gather_plan, paged_attention, store_kv


def _paged_batch(seq_lens, q_lens, hq, hkv, d, page_size, gen, dtype=torch.float32):
    """Random per-sequence K/V written into a NaN-poisoned cache through a shuffled page table."""
    b = len(seq_lens)
    max_pages = max(math.ceil(s / page_size) for s in seq_lens) + 2  # spare columns: garbage
    num_pages = b * max_pages + 5
    pages = torch.randperm(num_pages, generator=gen)
    page_table = pages[: b * max_pages].view(b, max_pages).to(torch.int32)
    k_cache = torch.full((num_pages, page_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    ks, vs = [], []
    for i, s in enumerate(seq_lens):
        k = torch.randn(s, hkv, d, generator=gen, dtype=dtype)
        v = torch.randn(s, hkv, d, generator=gen, dtype=dtype)
        for t in range(s):  # deliberately naive: independent of store_kv
            page = page_table[i, t // page_size]
            k_cache[page, t % page_size] = k[t]
            v_cache[page, t % page_size] = v[t]
        ks.append(k)
        vs.append(v)
    q = torch.randn(sum(q_lens), hq, d, generator=gen, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return q, k_cache, v_cache, page_table, seq, cu, ks, vs


def _naive(q, ks, vs, seq_lens, q_lens, scale):
    """Dense causal attention in float64, one query token at a time."""
    out = torch.empty(q.shape, dtype=torch.float64)
    hq, g = q.shape[1], q.shape[1] // ks[0].shape[1]
    row = 0
    for k, v, s, ql in zip(ks, vs, seq_lens, q_lens, strict=True):
        for i in range(ql):
            pos = s - ql + i
            for h in range(hq):
                kk = k[: pos + 1, h // g].double()
                w = torch.softmax(kk @ q[row, h].double() * scale, dim=0)
                out[row, h] = w @ v[: pos + 1, h // g].double()
            row += 1
    return out


CASES = {
    "prefill": ([1, 15, 16, 70], [1, 15, 16, 70]),
    "chunked": ([15, 16, 70, 100], [4, 16, 33, 1]),
    "decode": ([1, 15, 16, 17, 100], [1, 1, 1, 1, 1]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (3, 1)])
def test_matches_naive(case, hq, hkv):
    gen = torch.Generator().manual_seed(sorted(CASES).index(case) * 100 + hq * 10 + hkv)
    seq_lens, q_lens = CASES[case]
    q, kc, vc, pt, seq, cu, ks, vs = _paged_batch(seq_lens, q_lens, hq, hkv, 32, 16, gen)
    scale = 32**-0.5
    out = paged_attention(q, kc, vc, pt, seq, cu, scale)
    assert out.dtype == q.dtype and not out.isnan().any()
    torch.testing.assert_close(
        out.double(), _naive(q, ks, vs, seq_lens, q_lens, scale), atol=1e-5, rtol=1e-5
    )


def test_bf16_output_dtype_and_accuracy():
    gen = torch.Generator().manual_seed(1)
    seq_lens, q_lens = [40, 9], [40, 3]
    q, kc, vc, pt, seq, cu, ks, vs = _paged_batch(
        seq_lens, q_lens, 4, 2, 64, 8, gen, dtype=torch.bfloat16
    )
    out = paged_attention(q, kc, vc, pt, seq, cu, 0.125)
    assert out.dtype == torch.bfloat16
    ref = _naive(q, ks, vs, seq_lens, q_lens, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3)])
def test_fresh_prefill_matches_sdpa_exactly(hq, hkv):
    # The engine's greedy tokens are compared with HF, which runs exactly this SDPA call.
    gen = torch.Generator().manual_seed(2)
    q, kc, vc, pt, seq, cu, ks, vs = _paged_batch([77], [77], hq, hkv, 64, 16, gen)
    out = paged_attention(q, kc, vc, pt, seq, cu, 0.125)
    sdpa = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        ks[0].transpose(0, 1)[None],
        vs[0].transpose(0, 1)[None],
        is_causal=True,
        scale=0.125,
        enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, sdpa, atol=1e-6, rtol=1e-6)


def test_padding_rows_and_empty_sequences():
    # A sequence with no new tokens, and rows past cu_seqlens_q[-1], are left as zeros.
    gen = torch.Generator().manual_seed(3)
    q, kc, vc, pt, seq, cu, ks, vs = _paged_batch([20, 5], [0, 5], 2, 1, 16, 4, gen)
    q = torch.cat([q, torch.randn(2, 2, 16, generator=gen)])  # two padding rows
    out = paged_attention(q, kc, vc, pt, seq, cu, 0.25)
    ref = _naive(q[:5], ks[1:], vs[1:], [5], [5], 0.25)
    torch.testing.assert_close(out[:5].double(), ref, atol=1e-5, rtol=1e-5)
    assert (out[5:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_with_one_shared_plan_equals_each_sequence_alone_bitwise(dtype):
    # The engine builds one gather plan per forward and every layer reuses it; a sequence's
    # output must be the bits it gets alone (each SDPA call sees the same values and strides).
    # The padding entry (no new tokens) has a garbage table row: the plan must not read it.
    gen = torch.Generator().manual_seed(5)
    seq_lens, q_lens = [70, 33, 9, 41, 16], [70, 1, 0, 5, 1]
    q, kc, vc, pt, seq, cu, _, _ = _paged_batch(seq_lens, q_lens, 6, 2, 32, 16, gen, dtype)
    pt[2] = 10**6
    plan = gather_plan(pt, seq, cu, kc.shape[1])
    batched = [paged_attention(q, kc, vc, pt, seq, cu, 0.2, plan) for _ in range(2)]
    assert torch.equal(batched[0], batched[1])  # the plan is reusable: a second layer's call
    c = cu.tolist()
    for b, ql in enumerate(q_lens):
        if ql == 0:
            continue
        alone = paged_attention(
            q[c[b] : c[b + 1]], kc, vc, pt[b : b + 1], seq[b : b + 1],
            torch.tensor([0, ql], dtype=torch.int32), 0.2,
        )  # fmt: skip
        assert torch.equal(batched[0][c[b] : c[b + 1]], alone), b


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_store_kv_writes_exactly_its_slots(index_dtype):
    gen = torch.Generator().manual_seed(4)
    num_pages, page_size, hkv, d, t = 7, 4, 2, 8, 11
    kc = torch.full((num_pages, page_size, hkv, d), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    slots = torch.randperm(num_pages * page_size, generator=gen)[:t]
    k = torch.randn(t, hkv, d, generator=gen)
    v = torch.randn(t, hkv, d, generator=gen)
    store_kv(k, v, kc, vc, slots.to(index_dtype))
    for cache, src in ((kc, k), (vc, v)):
        flat = cache.view(-1, hkv, d)
        torch.testing.assert_close(flat[slots], src, atol=0, rtol=0)
        untouched = torch.ones(num_pages * page_size, dtype=torch.bool)
        untouched[slots] = False
        assert flat[untouched].isnan().all()


def test_store_kv_casts_to_cache_dtype():
    kc = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 1, 8)
    store_kv(k, k, kc, vc, torch.tensor([5, 0, 2]))
    assert torch.equal(kc.view(-1, 1, 8)[torch.tensor([5, 0, 2])], k.to(torch.bfloat16))
