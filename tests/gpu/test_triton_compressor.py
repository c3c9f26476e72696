"""The compressor window pooling kernel (kernels/triton_compressor.py) against its torch
reference (`pool_windows_reference`) on fresh random projections and slot states: prefill
chunks that start mid-window, decode steps with every row a candidate closer (the graph
layout, padding closers included), overlapping ratio 4 and plain ratios 16 / 128, the
DeepSeek-V4 dims (512 and the indexer's 128) and odd ones.

Quick tier (`pytest -m gpu`): a decode step at ratio 4 (overlap, 512), a 300-token prefill at ratio
128 and a mixed step at the indexer's ratio 4 x 128; gpu_full (`pytest -m gpu_full`): every other
ratio x dim x step."""

from __future__ import annotations

import pytest
import torch
from conftest import tiered

from kvrelay.kernels.triton_compressor import pool_windows
from kvrelay.models.deepseek_v4.batch_meta import build_meta
from kvrelay.models.deepseek_v4.pooled_compressor import pool_windows_reference

pytestmark = pytest.mark.gpu

STEPS = [  # (cached tokens per sequence, new tokens per sequence, closers_per_row)
    ([0, 5, 17, 3], [9, 1, 6, 1], False),
    ([0], [300], False),
    ([7, 15, 3, 64, 127, 255], [1] * 6, True),
    ([128, 4, 0], [1, 130, 2], False),
]


@tiered(
    "r,overlap,d,step",
    [
        (*c, step)
        for step in range(len(STEPS))
        for c in [(4, True, 512), (4, True, 128), (128, False, 512), (16, False, 40), (4, True, 24)]
    ],
    quick=[(4, True, 512, 2), (128, False, 512, 1), (4, True, 128, 0)],
    ids=lambda c: f"r{c[0]}{'-overlap' if c[1] else ''}-d{c[2]}-step{c[3]}",
)
def test_pool_windows_matches_reference(r, overlap, d, step):
    starts, counts, per_row = STEPS[step]
    gen = torch.Generator(device="cuda").manual_seed(hash((r, overlap, d, step)) % 2**31)
    coff, slots = 2 if overlap else 1, 9
    meta = build_meta(
        starts, counts, [list(range(1, 40))] * len(starts), list(range(1, len(starts) + 1)),
        (r,), 64, torch.device("cuda"), closers_per_row=per_row,
    )  # fmt: skip
    t = sum(counts)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda") * 2

    kv, score = rnd(t, coff * d), rnd(t, coff * d)
    pk, ps = rnd(slots, 2 * r, coff * d), rnd(slots, 2 * r, coff * d)  # two windows a slot
    prev = (rnd(slots, 2 * r, d), rnd(slots, 2 * r, d)) if overlap else (None, None)
    cl = meta.closers[r]
    want, want_first = pool_windows_reference(kv, score, pk, ps, *prev, meta, cl, r, d)
    got, got_first = pool_windows(kv, score, pk, ps, *prev, meta, cl, r, d)
    assert got.shape == want.shape and got.dtype == want.dtype
    valid = cl.valid  # padding closers' results are discarded (written to the dummy row/slot)
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    assert (got_first is None) == (want_first is None)
    if want_first is not None:
        for g, w in zip(got_first, want_first, strict=True):
            assert torch.equal(g[valid], w[valid])  # a gather: bit for bit
