"""DeepSeek-V4's kernels as `--deterministic` runs them on the GPU (runnable.py
`_invariant_triton_ops`): a row's output has the same bits alone as among other rows, whatever
the rows around it bring (more entries, other experts, a longer step). One check per kernel, so
that an engine-level difference (test_deterministic_gpu.py) points at its cause. The defaults
beside them are reported, not asserted."""

from __future__ import annotations

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
ROWS = (0, 5, 63)  # rows checked alone


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def test_sparse_mqa_in_one_split_is_row_invariant() -> None:
    """64 rows of 64 heads over a window (128) and compressed entries; the batch lists up to 900
    entries a row (-1 after a row's own), a row alone only its own: one split per row gives
    the same bits; the default split count (from the row count) is reported."""
    g = _gen(1)
    t, h, d, ka = 64, 64, 512, 128
    q = torch.randn(t, h, d, generator=g, device="cuda").to(torch.bfloat16)
    kv_a = torch.randn(4096, d, generator=g, device="cuda").to(torch.bfloat16)
    kv_b = torch.randn(2048, d, generator=g, device="cuda").to(torch.bfloat16)
    idx_a = torch.randint(0, 4096, (t, ka), generator=g, device="cuda", dtype=torch.int32)
    idx_a[:, :17] = -1  # a window not yet full
    own = torch.randint(1, 900, (t,), generator=g, device="cuda")
    idx_b = torch.randint(0, 2048, (t, 900), generator=g, device="cuda", dtype=torch.int32)
    idx_b = torch.where(torch.arange(900, device="cuda")[None, :] < own[:, None], idx_b, -1)
    sinks = torch.randn(h, generator=g, device="cuda")
    batch = sparse_mqa(q, kv_a, idx_a, kv_b, idx_b, sinks, d**-0.5, num_splits=1)
    default = sparse_mqa(q, kv_a, idx_a, kv_b, idx_b, sinks, d**-0.5)
    moved = 0
    for r in ROWS:
        n = int(own[r])
        args = (q[r : r + 1], kv_a, idx_a[r : r + 1], kv_b, idx_b[r : r + 1, :n], sinks, d**-0.5)
        assert torch.equal(sparse_mqa(*args, num_splits=1)[0], batch[r]), r
        moved += not torch.equal(sparse_mqa(*args)[0], default[r])
    print(f"default splits: {moved} of {len(ROWS)} rows differ alone")


@pytest.mark.parametrize("fp4", [True, False], ids=["nvfp4", "dense"])
def test_fused_moe_at_the_invariant_config_is_row_invariant(fp4: bool) -> None:
    """A token alone, then among 63 and 299 others routed at random (its experts' blocks hold
    other rows at other places): the same bits at the one config; `default_config` (by tokens
    per expert) reported."""
    g = _gen(2)
    e, hd, inter, k = 32, 512, 256, 6
    ex = _experts(e, hd, inter, fp4, torch.bfloat16, g)
    x = torch.randn(300, hd, generator=g, device="cuda").to(torch.bfloat16)
    w, idx = _routing(300, e, k, "topk", g)
    moved = 0
    for t in (64, 300):
        batch = fused_experts(x[:t], w[:t], idx[:t], ex, INVARIANT_CONFIG)
        default = fused_experts(x[:t], w[:t], idx[:t], ex)
        for r in ROWS:
            one = (x[r : r + 1], w[r : r + 1], idx[r : r + 1], ex)
            assert torch.equal(fused_experts(*one, INVARIANT_CONFIG)[0], batch[r]), (t, r)
            moved += not torch.equal(fused_experts(*one)[0], default[r])
    print(f"default config: {moved} of {2 * len(ROWS)} rows differ alone")


def test_hc_pre_past_its_default_limit_is_row_invariant() -> None:
    """The mHC pre kernel serves every step size in the mode, also past PRE_MAX_TOKENS (where the
    default path hands over to the gates kernel): a token alone == the token among 600."""
    t = PRE_MAX_TOKENS + 88
    hc, norm = mhc_modules(1024)
    streams, pending = mhc_inputs(t, 1024, torch.bfloat16, 3)
    with torch.no_grad():
        batch = hc.pre_fused(hc_pre, streams, pending, norm)
        for r in (0, 300, t - 1):
            one = hc.pre_fused(
                hc_pre, streams[r : r + 1], tuple(p[r : r + 1] for p in pending), norm
            )
            for a, b in zip(one, batch, strict=True):
                assert torch.equal(a[0], b[r]), r


def test_indexer_top_k_is_row_invariant() -> None:
    """A query row's chosen entries alone == among 64 rows of other sequences whose key lists are
    longer (more columns)."""
    g = _gen(4)
    t, h, d, n, topk = 64, 16, 128, 700, 64
    q = torch.randn(t, h, d, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(t, h, generator=g, device="cuda") * (d**-0.5 * h**-0.5)
    keys = torch.randn(4000, d, generator=g, device="cuda").to(torch.bfloat16)
    rows = torch.randint(0, 4000, (t, n), generator=g, device="cuda")
    seq = torch.arange(t, device="cuda")
    vis = torch.randint(1, n, (t,), generator=g, device="cuda")
    batch = indexer_topk(q, w, keys, None, rows, seq, vis, topk)
    for r in ROWS:
        m = int(vis[r])
        one = indexer_topk(
            q[r : r + 1], w[r : r + 1], keys, None, rows[r : r + 1, :m], seq[:1], vis[r : r + 1],
            topk,
        )  # fmt: skip
        k = one.shape[1]
        assert torch.equal(one[0], batch[r, :k]) and (batch[r, k:] == -1).all(), r


@pytest.mark.parametrize("op", ["sum", "mean", "softmax", "topk", "einsum", "linear"])
def test_the_dispatch_mode_on_cuda_is_row_invariant(op: str) -> None:
    """The eager glue's reductions, top-k and products under the mode on CUDA tensors (the
    routing's sigmoid scores, a stream sum, a Sinkhorn softmax): a row alone == the row among
    1000 (blocked to fixed shapes; the linears through the invariant kernel)."""
    g = _gen(5)
    x = torch.randn(1000, 4, 256, generator=g, device="cuda")
    wt = torch.randn(8, 3, 256, generator=g, device="cuda")
    lin = torch.randn(512, 1024, generator=g, device="cuda").to(torch.bfloat16)
    fns = {
        "sum": lambda a: a.sum(dim=1),
        "mean": lambda a: a.square().mean(-1),
        "softmax": lambda a: a.softmax(dim=-1),
        "topk": lambda a: a.flatten(1).sigmoid().topk(6, dim=-1).indices,
        "einsum": lambda a: torch.einsum("ngi,gri->ngr", a, wt[:4]),
        "linear": lambda a: torch.nn.functional.linear(a.flatten(1).to(torch.bfloat16), lin),
    }
    fn = fns[op]
    with batch_invariant.scope(True):
        batch = fn(x)
        for r in (0, 17, 999):
            assert torch.equal(fn(x[r : r + 1])[0], batch[r]), r
