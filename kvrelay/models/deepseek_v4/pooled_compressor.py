"""A compressor step over a varlen batch whose partial windows live in per-request state slots
and whose entries go straight into the paged pool: the batched form of `Compressor.forward`.

For every row that closes a window the r (or 2r, overlapping) pooled rows are gathered from
three places: this step's projections (positions >= the sequence's chunk start), the state
slot's pending rows (the window open when the step began), and for overlapping compressors the
slot's previous-window half (the window closed before the step). Then the slot is updated: the
rows of the last two windows go to pending, the last two closed windows' first halves to prev
(a slot row is position % 2r: cache_pool.py says why), and a window that closes at a page end
leaves its first half with that page, for the prefix cache. Padding and non-closing candidates
write to the dummy page / slot 0, so the op has fixed shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvrelay.models.deepseek_v4.batch_meta import BatchMeta, Closers, CompressPlan
from kvrelay.models.deepseek_v4.compressor import Compressor


def pool_windows_reference(
    kv: torch.Tensor,
    score: torch.Tensor,
    pending_kv: torch.Tensor,
    pending_score: torch.Tensor,
    prev_kv: torch.Tensor | None,
    prev_score: torch.Tensor | None,
    meta: BatchMeta,
    cl: Closers,
    r: int,
    d: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The windows the closers complete, gathered and pooled: (pooled [C, d] wide, and for
    overlapping compressors the closing window's first halves (kv, score) [C, r, d], which the
    caller leaves in the prev state). kv, score: this step's projections [T, coff*d]; slot
    tensors as in `compress_step`. The torch reference of `kernels.triton_compressor`."""
    overlap = prev_kv is not None
    coff = 2 if overlap else 1
    t_n = kv.shape[0]
    pk, ps = pending_kv.view(-1, coff * d), pending_score.view(-1, coff * d)
    seq = meta.seq[cl.rows]
    start, slot = meta.chunk_start[seq], meta.slots[seq]
    base = meta.tok_base[seq]
    wstart = meta.positions[cl.rows] + 1 - r  # first position of the closing window
    offs = torch.arange(r, device=kv.device)

    def locate(q: torch.Tensor):
        """(in this step?, row in this step's projections, row in the slot tensors)."""
        in_step = q >= start[:, None]
        tok = (base[:, None] + q - start[:, None]).clamp(0, t_n - 1)
        flat = slot[:, None] * 2 * r + q.remainder(2 * r)
        return in_step, tok, flat

    cur = wstart[:, None] + offs[None, :]  # [C, r]
    in_step, tok, flat = locate(cur)
    cur_kv = torch.where(in_step[..., None], kv[tok], pk[flat])  # [C, r, coff*d]
    cur_score = torch.where(in_step[..., None], score[tok], ps[flat])
    if not overlap:
        return (cur_score.softmax(dim=1) * cur_kv).sum(dim=1), None
    prv = cur - r
    p_step, p_tok, p_flat = locate(prv)
    open_start = start // r * r  # the window open when the step began sits in pending
    p_pending = (prv >= open_start[:, None])[..., None]
    first = prv[:, :1] >= 0  # [C, 1]: no previous window before the first one
    prev_kv_g = torch.where(
        p_step[..., None],
        kv[p_tok, :d],
        torch.where(p_pending, pk[p_flat, :d], prev_kv.view(-1, d)[p_flat]),
    )
    prev_score_g = torch.where(
        p_step[..., None],
        score[p_tok, :d],
        torch.where(p_pending, ps[p_flat, :d], prev_score.view(-1, d)[p_flat]),
    )
    prev_kv_g = torch.where(first[..., None], prev_kv_g, 0.0)
    prev_score_g = torch.where(first[..., None], prev_score_g, float("-inf"))
    pool_kv = torch.cat((prev_kv_g, cur_kv[:, :, d:]), dim=1)
    pool_score = torch.cat((prev_score_g, cur_score[:, :, d:]), dim=1)
    pooled = (pool_score.softmax(dim=1) * pool_kv).sum(dim=1)
    return pooled, (cur_kv[:, :, :d], cur_score[:, :, :d])


PoolWindows = Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]]


def compress_step(
    comp: Compressor,
    kv: torch.Tensor,
    gate: torch.Tensor,
    meta: BatchMeta,
    plan: CompressPlan,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    pending_kv: torch.Tensor,
    pending_score: torch.Tensor,
    prev_kv: torch.Tensor | None,
    prev_score: torch.Tensor | None,
    store: Callable[[torch.Tensor, torch.Tensor], None],
    pool_windows: PoolWindows = pool_windows_reference,
    page_prev: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """kv, gate: [T, coff*d] the compressor's wide projections of the step's normed inputs
    (`Attention.wide_linears`). Slot tensors: [slots, 2r, coff*d] (prev: [slots, 2r, d]).
    `plan`: the step's rows for this ratio (`StepIndex.compress_plan`); `cos_sin`: the rotation
    at each closing window's first position; `store(rows, entries)` writes entries;
    `pool_windows`: the reference above or its Triton kernel; `page_prev`: the per-page prev
    state (kv, score) [pages, r, d] of overlapping compressors."""
    r, d = comp.ratio, comp.dim
    score = gate + comp.position_bias[plan.bias_rows]
    cl = meta.closers[r]
    pooled, first_half = pool_windows(
        kv, score, pending_kv, pending_score, prev_kv, prev_score, meta, cl, r, d
    )
    store(plan.store_rows, comp._finish(pooled, *cos_sin))

    # State after the step: rows of each sequence's last two windows go to pending ...
    pk, ps = pending_kv.view(-1, kv.shape[1]), pending_score.view(-1, kv.shape[1])
    pk.index_copy_(0, plan.pending_rows, kv)
    ps.index_copy_(0, plan.pending_rows, score)
    # ... and the last two closed windows' first halves to prev (overlapping compressors).
    if first_half is not None:
        prev_kv.view(-1, r, d).index_copy_(0, plan.prev_rows, first_half[0])
        prev_score.view(-1, r, d).index_copy_(0, plan.prev_rows, first_half[1])
        if page_prev is not None:
            page_prev[0].index_copy_(0, plan.page_prev, first_half[0])
            page_prev[1].index_copy_(0, plan.page_prev, first_half[1])
