"""mHC gates in one launch: from the stream-mix projection [T, (2 + n) * n] to the pre weights,
the post weights and the Sinkhorn-projected comb matrix of every token. The torch form
(`HyperConnection.gates`, the reference) is ~4 + 4 * iters small kernels per sub-layer; here
each program keeps BLOCK_T tokens' n x n matrices in registers through all iterations.
"""

from __future__ import annotations

import torch

from kvrelay.kernels.triton_pointwise import _jit, tl, triton

BLOCK_T = 32


@_jit
def _hc_gates_kernel(
    mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, hc_eps,
    N: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tm = t < T
    width = (2 + N) * N
    j = tl.arange(0, N)
    row = t.to(tl.int64)[:, None] * width
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    m2 = tm[:, None]
    pre = tl.load(mix_ptr + row + j[None, :], mask=m2, other=0.0) * s0 + tl.load(base_ptr + j)
    pre = tl.sigmoid(pre) + hc_eps
    post = tl.load(mix_ptr + row + N + j[None, :], mask=m2, other=0.0) * s1
    post = 2 * tl.sigmoid(post + tl.load(base_ptr + N + j))
    out = t.to(tl.int64)[:, None] * N + j[None, :]
    tl.store(pre_ptr + out, pre, mask=m2)
    tl.store(post_ptr + out, post, mask=m2)
    # comb[t, a, b] = mix[t, 2N + a*N + b] * s2 + base[2N + a*N + b]
    ab = j[:, None] * N + j[None, :]
    m3 = tm[:, None, None]
    c = tl.load(mix_ptr + row[:, :, None] + 2 * N + ab[None, :, :], mask=m3, other=0.0)
    c = c * s2 + tl.load(base_ptr + 2 * N + ab)[None, :, :]
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = c / tl.sum(c, axis=2)[:, :, None] + hc_eps  # row softmax + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    tl.store(comb_ptr + t.to(tl.int64)[:, None, None] * N * N + ab[None, :, :], c, mask=m3)


def hc_gates(
    mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix [T, (2+n)*n] fp32 -> (pre [T, n], post [T, n], comb [T, n, n]) fp32; n a power of 2."""
    t = mix.shape[0]
    mix = mix.contiguous()
    pre = torch.empty(t, n, dtype=torch.float32, device=mix.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=mix.device)
    grid = (triton.cdiv(t, BLOCK_T),)
    _hc_gates_kernel[grid](
        mix, scale.float().contiguous(), base.float().contiguous(), pre, post, comb, t, hc_eps,
        N=n, ITERS=iters, BLOCK=BLOCK_T,
    )  # fmt: skip
    return pre, post, comb
