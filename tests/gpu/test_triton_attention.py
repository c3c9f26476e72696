"""The Triton paged-attention kernels on the GPU against the torch reference.

Quick tier (`pytest -m gpu`): the prefill kernel once (bf16, D=64, GQA 4), the decode kernels once
(fp32, D=128, GQA 8; bf16 in the graph-replay test), store_kv; both kernels also run in fp32 at
SmolLM2's shape (D=64, GQA 3, pages of 16) in test_engine_gpu.py. The other head-dim x GQA x
page-size x dtype configs and the forced split counts: gpu_full (`pytest -m gpu_full`)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiered
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvrelay.kernels.reference import paged_attention as ref_attention
from kvrelay.kernels.triton_attention import paged_attention, paged_decode_attention, store_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Relative error ||out - ref|| / ||ref||. fp32 dots run as "ieee", so fp32 is near exact.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # measured on the H200: 7e-7, 2e-3
HKV = 2

# One config per (dtype, head dim, GQA ratio); page sizes rotate so each meets each dtype.
CONFIGS = [
    (dtype, d, g, (16, 64, 256)[i % 3])
    for i, (dtype, d, g) in enumerate(
        (dtype, d, g)
        for dtype in (torch.bfloat16, torch.float32)
        for d in (64, 128)
        for g in (1, 4, 8)
    )
]
IDS = [f"{str(c[0])[6:]}-d{c[1]}-g{c[2]}-p{c[3]}" for c in CONFIGS]

# Fresh prefills (1, 17, 4100 tokens), chunks of long contexts, and decode tokens, mixed.
PREFILL_SEQ = [1, 17, 300, 2000, 4100, 1000]
PREFILL_Q = [1, 17, 128, 1, 4100, 999]
DECODE_SEQ = [1, 17, 255, 256, 2000, 4100, 0, 3]  # 0: a padded CUDA-graph slot


def _batch(seq_lens, t, hq, d, page_size, dtype, max_pages=None):
    """Random K/V behind a shuffled page table; unused slots and spare pages hold NaN."""
    b = len(seq_lens)
    need = max(math.ceil(s / page_size) for s in seq_lens)
    max_pages = max_pages or need + 1
    num_pages = b * max_pages + 3
    page_table = torch.randperm(num_pages, device="cuda")[: b * max_pages].view(b, max_pages)
    k_cache = torch.full((num_pages, page_size, HKV, d), float("nan"), dtype=dtype, device="cuda")
    v_cache = torch.full_like(k_cache, float("nan"))
    for i, s in enumerate(seq_lens):
        pos = torch.arange(s, device="cuda")
        pages = page_table[i, pos // page_size]
        k_cache[pages, pos % page_size] = torch.randn(s, HKV, d, device="cuda", dtype=dtype)
        v_cache[pages, pos % page_size] = torch.randn(s, HKV, d, device="cuda", dtype=dtype)
    q = torch.randn(t, hq, d, device="cuda", dtype=dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, page_table.to(torch.int32), seq


def _cu(q_lens):
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).cuda()


def _rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _reference(q, kc, vc, pt, seq, cu, scale):
    """The torch reference with SDPA's math backend: plain fp32 (no TF32) on the GPU."""
    with sdpa_kernel(SDPBackend.MATH):
        return ref_attention(q, kc, vc, pt, seq, cu, scale)


def _decode_ref(q, kc, vc, pt, seq, scale):
    """Reference for one token per sequence; seq_len 0 gives zeros."""
    live = seq > 0
    cu = torch.cat([seq.new_zeros(1), live.to(torch.int32).cumsum(0)]).to(torch.int32)
    ref = torch.zeros_like(q)
    ref[live] = _reference(q[live], kc, vc, pt, seq, cu, scale)
    return ref


@tiered("dtype,d,g,page_size", CONFIGS, quick=["bfloat16-d64-g4-p64"], ids=IDS)
def test_paged_attention_mixed_batch(dtype, d, g, page_size):
    torch.manual_seed(0)
    q, kc, vc, pt, seq = _batch(PREFILL_SEQ, sum(PREFILL_Q), HKV * g, d, page_size, dtype)
    cu = _cu(PREFILL_Q)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kc, vc, pt, seq, cu, d**-0.5, max(PREFILL_Q), out=out)
    assert not out.isnan().any(), "some outputs were not written"
    ref = _reference(q, kc, vc, pt, seq, cu, d**-0.5)
    assert _rel_err(out, ref) <= TOL[dtype]


@tiered("dtype,d,g,page_size", CONFIGS, quick=["float32-d128-g8-p256"], ids=IDS)
def test_paged_decode_attention_mixed_lengths(dtype, d, g, page_size):
    torch.manual_seed(1)
    q, kc, vc, pt, seq = _batch(DECODE_SEQ, len(DECODE_SEQ), HKV * g, d, page_size, dtype)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kc, vc, pt, seq, d**-0.5, out=out)
    assert not out.isnan().any(), "some outputs were not written"
    assert (out[DECODE_SEQ.index(0)] == 0).all()
    assert _rel_err(out, _decode_ref(q, kc, vc, pt, seq, d**-0.5)) <= TOL[dtype]


@pytest.mark.gpu_full
@pytest.mark.parametrize("num_splits", [1, 7, 32, 64])
def test_paged_decode_attention_explicit_splits(num_splits):
    torch.manual_seed(2)
    q, kc, vc, pt, seq = _batch(DECODE_SEQ, len(DECODE_SEQ), 8, 64, 16, torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kc, vc, pt, seq, 0.125, num_splits=num_splits, out=out)
    assert not out.isnan().any()
    assert _rel_err(out, _decode_ref(q, kc, vc, pt, seq, 0.125)) <= TOL[torch.bfloat16]


def test_paged_decode_attention_cuda_graph_replay():
    torch.manual_seed(3)
    hq, d, page_size, max_pages = 32, 64, 16, 256  # room for 4096 tokens per sequence
    lens = [[5, 4096, 1000, 1], [4000, 0, 17, 2048], [1, 1, 1, 1]]
    static = _batch(lens[0], 4, hq, d, page_size, torch.bfloat16, max_pages)
    q, kc, vc, pt, seq = static
    paged_decode_attention(q, kc, vc, pt, seq, 0.125)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, kc, vc, pt, seq, 0.125)
    for new_lens in lens:
        fresh = _batch(new_lens, 4, hq, d, page_size, torch.bfloat16, max_pages)
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        assert _rel_err(out, _decode_ref(q, kc, vc, pt, seq, 0.125)) <= TOL[torch.bfloat16]


def test_store_kv_on_gpu_is_graph_capturable():
    kc = torch.full((8, 16, 2, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    vc = torch.full_like(kc, float("nan"))
    k = torch.randn(5, 2, 64, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    slots = torch.tensor([3, 17, 64, 65, 127], dtype=torch.int32, device="cuda")
    store_kv(k, v, kc, vc, slots)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(k, v, kc, vc, slots)
    kc.fill_(float("nan"))
    slots.copy_(torch.tensor([0, 1, 2, 100, 101]))
    graph.replay()
    torch.cuda.synchronize()
    flat = kc.view(-1, 2, 64)
    assert torch.equal(flat[slots.long()], k)
    assert flat.isnan().all(dim=(1, 2)).sum().item() == flat.shape[0] - 5
