"""The batch-invariant paged attention kernel (`--deterministic` on the GPU) against the torch
reference on fresh random inputs, and its point: a query row has the same bits alone and inside
batches of 2..256 sequences with random neighbours (decode rows and prefill chunks mixed), as a
prefill row and as a decode row at the same position, and under CUDA graph replay.

The default kernels are checked beside it, not asserted: whether split-K decode gives a row other
bits in another batch follows how many SMs the batch leaves free."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kernels import reference as ref
from kvrelay.kernels import triton_attention as default
from kvrelay.kernels.triton_invariant_attention import invariant_paged_attention as attend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SCALE = 0.125


class Batch:
    """Sequences (context length, new tokens) over random pages of one random cache."""

    def __init__(self, seqs, hq, hkv, d, page, dtype, g):
        pages = [-(-ctx // page) for ctx, _ in seqs]
        n = sum(pages) + 1  # page 0 stays unassigned
        dev = "cuda"
        self.k = torch.randn(n, page, hkv, d, device=dev, generator=g).to(dtype)
        self.v = torch.randn(n, page, hkv, d, device=dev, generator=g).to(dtype)
        order = torch.randperm(n - 1, device=dev, generator=g) + 1
        self.table = torch.zeros(len(seqs), max(pages), dtype=torch.int32, device=dev)
        at = 0
        for b, m in enumerate(pages):
            self.table[b, :m] = order[at : at + m]
            at += m
        self.lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=dev)
        news = torch.tensor([0] + [q for _, q in seqs])
        self.cu = news.cumsum(0).to(torch.int32).to(dev)
        self.q = torch.randn(int(news.sum()), hq, d, device=dev, generator=g).to(dtype)

    def rows(self, b: int) -> slice:
        return slice(int(self.cu[b]), int(self.cu[b + 1]))

    def run(self, fn=attend):
        return fn(self.q, self.k, self.v, self.table, self.lens, self.cu, SCALE)


SHAPES = [(9, 3, 64, 16), (32, 8, 128, 16), (8, 1, 128, 64)]  # SmolLM2, llama-1b-like, MQA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hq{}-hkv{}-d{}-p{}".format(*s))
def test_matches_reference(shape, dtype):
    hq, hkv, d, page = shape
    g = torch.Generator(device="cuda").manual_seed(hq + d)
    seqs = [(1, 1), (63, 63), (64, 1), (65, 9), (700, 1), (1500, 300)]
    b = Batch(seqs, hq, hkv, d, page, dtype, g)
    out, want = b.run(), b.run(ref.paged_attention)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_has_the_same_bits_in_any_batch(dtype):
    """A target sequence (a decode row at 777, or a 40-token chunk ending there) alone, then
    among 1..255 random neighbours at a random place in the batch; its last row also as a decode
    row alone at the same position."""
    hq, hkv, d, page = SHAPES[0]
    g = torch.Generator(device="cuda").manual_seed(5)
    cpu = torch.Generator().manual_seed(5)
    seen_default_vary = []
    for new in (1, 40):
        target = (777, new)
        alone = Batch([target], hq, hkv, d, page, dtype, g)
        out_alone = alone.run()
        decode = Batch([(777, 1)], hq, hkv, d, page, dtype, g)
        decode.k, decode.v, decode.table = alone.k, alone.v, alone.table
        decode.q = alone.q[-1:].clone()
        assert torch.equal(decode.run()[0], out_alone[-1])  # prefill row == decode row
        for n in (2, 3, 8, 17, 64, 129, 256):
            others = [
                (int(torch.randint(1, 2000, (1,), generator=cpu)), 1 if i % 3 else 5)
                for i in range(n - 1)
            ]
            others = [(max(c, q), q) for c, q in others]
            at = int(torch.randint(n, (1,), generator=cpu))
            seqs = others[:at] + [target] + others[at:]
            mixed = Batch(seqs, hq, hkv, d, page, dtype, g)
            # the target's pages and queries, copied into this batch's cache at its own pages
            pages = -(-777 // page)
            mixed.k[mixed.table[at, :pages].long()] = alone.k[alone.table[0, :pages].long()]
            mixed.v[mixed.table[at, :pages].long()] = alone.v[alone.table[0, :pages].long()]
            mixed.q[mixed.rows(at)] = alone.q
            assert torch.equal(mixed.run()[mixed.rows(at)], out_alone), (new, n, at)
            if new == 1 and all(q == 1 for _, q in seqs):
                got = mixed.run(lambda *a: default.paged_decode_attention(*a[:5], a[6]))
                solo = alone.run(lambda *a: default.paged_decode_attention(*a[:5], a[6]))
                if not torch.equal(got[mixed.rows(at)], solo):
                    seen_default_vary.append(n)
    print(f"{dtype}: the split-K decode kernel gave the row other bits at n = {seen_default_vary}")


def test_graph_replay_gives_the_eager_bits():
    """Captured once for a batch of 8 decode rows, replayed with other contexts: every row equals
    the kernel run eagerly on that row alone."""
    hq, hkv, d, page = SHAPES[0]
    g = torch.Generator(device="cuda").manual_seed(9)
    b = Batch([(300 + 50 * i, 1) for i in range(8)], hq, hkv, d, page, torch.bfloat16, g)
    b.run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = b.run()
    for trial in range(3):
        b.lens.copy_(torch.randint(1, 350, (8,), device="cuda", generator=g, dtype=torch.int32))
        b.q.copy_(torch.randn(b.q.shape, device="cuda", generator=g).to(b.q.dtype))
        graph.replay()
        for i in range(8):
            solo = attend(
                b.q[i : i + 1].clone(), b.k, b.v, b.table[i : i + 1].clone(),
                b.lens[i : i + 1].clone(), torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                SCALE,
            )  # fmt: skip
            assert torch.equal(out[i : i + 1], solo), (trial, i)
