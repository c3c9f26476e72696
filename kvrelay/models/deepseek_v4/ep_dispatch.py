"""Expert parallel with all-to-all token dispatch (`--ep-dispatch all-to-all`).

Each rank owns 1/N of the step's tokens (contiguous rows). For its own tokens it routes, sends
each token's hidden state once to every rank that holds one of its selected experts (with the
token's local expert ids and routing weights for that rank), the expert owners compute and send
their weighted sums back, and the token's owner adds them and the shared expert (held whole on
every rank in this mode). An all-gather then gives every rank every token's output, because
attention runs on all tokens (its heads are split, not its tokens).

Communication per MoE: counts, hidden states, ids and weights out, weighted sums back
(`torch.distributed.all_to_all_single` with split sizes: gloo and NCCL both implement it), and
the all-gather. With the residual replicated on every rank (TP attention) that is more bytes
than the one all-reduce of `--ep-dispatch all-reduce` at 2 ranks and about as many at 8; the
dispatch pays only once tokens stay partitioned between MoEs (data-parallel or sequence-parallel
attention), which is what this is the building block for. See README ("Expert parallel").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvrelay.layers.parallel import TPGroup


def own_rows(n: int, tp: TPGroup) -> tuple[int, int]:
    """[lo, hi): the rows this rank owns (sizes differ by at most one between ranks)."""
    return tp.rank * n // tp.world, (tp.rank + 1) * n // tp.world


def pair_plan(idx: torch.Tensor, per_rank: int, world: int):
    """(token, rank) pairs, one per token and each rank holding one of its experts, sorted by
    rank: (tokens [P], ranks [P], pairs per rank [world])."""
    dest = idx // per_rank  # [m, k]: the rank of each selected expert
    need = torch.zeros(idx.shape[0], world, dtype=torch.bool, device=idx.device)
    need.scatter_(1, dest, True)
    rank, tok = need.t().nonzero(as_tuple=True)  # rank-major: the order all_to_all sends in
    return tok, rank, torch.bincount(rank, minlength=world)


def _exchange(x: torch.Tensor, out_rows: list[int], in_rows: list[int], tp: TPGroup):
    import torch.distributed as dist

    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=tp.group)
    return out


def dispatch_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    per_rank: int,
    tp: TPGroup,
    compute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Routed output [m, hidden] (weights' dtype) of this rank's tokens x [m, hidden], routed to
    global experts `idx` [m, k] with `weights` [m, k]; `compute(x, weights, local_idx)` runs this
    rank's experts on the rows it receives (local ids, -1 for another rank's expert)."""
    tok, rank, counts = pair_plan(idx, per_rank, tp.world)
    send = counts.tolist()
    recv = _exchange(counts, [1] * tp.world, [1] * tp.world, tp).tolist()
    ids = idx[tok] - (rank * per_rank)[:, None]
    ids = torch.where((ids >= 0) & (ids < per_rank), ids, -1)  # only the receiver's experts
    x_in = _exchange(x[tok], recv, send, tp)
    ids_in = _exchange(ids, recv, send, tp)
    w_in = _exchange(weights[tok], recv, send, tp)
    y = compute(x_in, w_in, ids_in)
    back = _exchange(y, send, recv, tp)  # each pair's weighted sum, in the order it was sent
    out = torch.zeros(x.shape[0], x.shape[1], dtype=weights.dtype, device=x.device)
    return out.index_add_(0, tok, back.to(out.dtype))


def gather_rows(own: torch.Tensor, n: int, tp: TPGroup) -> torch.Tensor:
    """Every rank's own rows [n_r, ...] put together in rank order: [n, ...] on every rank."""
    import torch.distributed as dist

    size = -(-n // tp.world)  # all_gather needs equal parts: pad to the largest
    padded = own.new_zeros((size, *own.shape[1:]))
    padded[: own.shape[0]] = own
    parts = [torch.empty_like(padded) for _ in range(tp.world)]
    dist.all_gather(parts, padded, group=tp.group)
    bounds = [r * n // tp.world for r in range(tp.world + 1)]
    return torch.cat([p[: bounds[r + 1] - bounds[r]] for r, p in enumerate(parts)])
