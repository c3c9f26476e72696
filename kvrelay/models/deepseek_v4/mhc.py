"""Manifold-constrained hyper-connections (mHC): the hc_mult residual streams around each sub-layer,
the Sinkhorn projection of their mixing matrix, and the final stream collapse (hyper head)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.models.deepseek_v4.fusion import fusable
from kvrelay.models.deepseek_v4.precision import wide, wide_dtype

# a sub-layer's merge not yet applied to the streams: (out [T, D], post [T, n], comb [T, n, n])
Pending = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Near doubly-stochastic [..., n, n]: row softmax (+eps), then alternate column/row
    normalisation, `iters` column normalisations in all."""
    c = logits.softmax(dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


@fusable
def _stream_mix(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """(flatten(X) . fn^T) * rsqrt(mean(flatten(X)^2) + eps), in the wide dtype."""
    flat = wide(streams).flatten(-2)
    rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(flat, fn.to(flat.dtype)) * rms


@fusable
def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_i pre_i * X_i: the sub-layer's input [T, D] from the streams [T, n, D]."""
    return (pre[..., None] * wide(streams)).sum(dim=1).to(streams.dtype)


@fusable
def merge_streams(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """X'_j = post_j * out + sum_i comb[i, j] * X_i (comb is applied transposed)."""
    w, c = wide(streams), comb.to(wide_dtype(streams.dtype))
    mixed = c[:, 0, :, None] * w[:, None, 0]  # a sum over the n streams, written out so that
    for i in range(1, w.shape[1]):  # the compiled form is one kernel (einsum would be a bmm)
        mixed = mixed + c[:, i, :, None] * w[:, None, i]
    return (post.to(w.dtype)[..., None] * wide(out)[:, None, :] + mixed).to(streams.dtype)


class HyperConnection(nn.Module):
    """Pre/post/comb weights of one sub-layer (attention or FFN); parameters stay fp32."""

    def __init__(
        self,
        hc_mult: int,
        hidden_size: int,
        sinkhorn_iters: int,
        hc_eps: float,
        norm_eps: float,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        n, wdt = hc_mult, wide_dtype(dtype)
        self.hc_mult, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden_size, dtype=wdt))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=wdt))
        self.scale = nn.Parameter(torch.ones(3, dtype=wdt))

    def forward(
        self, streams: torch.Tensor, gates_fn: Callable | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> (sub-layer input [T, D], post [T, n], comb [T, n, n]).
        `gates_fn(mix, scale, base, n, iters, eps)` replaces `gates` (the fused kernel)."""
        mix = _stream_mix(streams, self.fn, self.norm_eps)
        if gates_fn is not None and mix.dtype == torch.float32:
            pre, post, comb = gates_fn(
                mix, self.scale, self.base, self.hc_mult, self.iters, self.hc_eps
            )
        else:
            pre, post, comb = self.gates(mix)
        return collapse(pre, streams), post, comb

    def pre_fused(
        self,
        kernel: Callable,
        streams: torch.Tensor,
        pending: Pending | None,
        norm: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fast path's pre side in one call of `kernel` (kernels.triton_mhc.hc_pre): merge
        `pending` (out, post, comb of the sub-layer before; None for the first) into the
        streams, then `forward` and the sub-layer's `norm` (an RMSNorm) of its input ->
        (streams, normed input, post, comb)."""
        return kernel(
            streams, pending, self.fn, self.scale, self.base, self.iters, self.hc_eps,
            self.norm_eps, norm.weight, norm.eps,
        )  # fmt: skip

    def gates(self, mix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stream-mix projection [T, (2+n)*n] -> pre [T, n], post [T, n], comb [T, n, n]."""
        n = self.hc_mult
        base, scale = self.base.to(mix.dtype), self.scale.to(mix.dtype)
        pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + self.hc_eps
        post = 2 * torch.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        comb_logits = (mix[:, 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n))
        return pre, post, sinkhorn(comb_logits, self.iters, self.hc_eps)

    merge = staticmethod(merge_streams)


class HyperHead(nn.Module):
    """Collapses the streams into one hidden state before the final norm and the LM head."""

    def __init__(
        self,
        hc_mult: int,
        hidden_size: int,
        hc_eps: float,
        norm_eps: float,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        wdt = wide_dtype(dtype)
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size, dtype=wdt))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=wdt))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=wdt))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mix = _stream_mix(streams, self.hc_fn, self.norm_eps)
        pre = torch.sigmoid(mix * self.hc_scale.to(mix.dtype) + self.hc_base.to(mix.dtype))
        pre = pre + self.hc_eps
        return (pre[..., None] * wide(streams)).sum(dim=1).to(streams.dtype)
