"""DeepSeek-V4 over a varlen batch in one pass per layer: every row of every sequence goes
through each layer together, attention included (`pooled_attention`), with no Python loop over
sequences and no host sync, so a decode step can be captured in a CUDA graph.

The per-sequence path (`paged.forward_paged`) stays as the oracle this one is tested against.
"""

from __future__ import annotations

import torch

from kvrelay.layers.step_profile import StepProfiler
from kvrelay.models.deepseek_v4.batch_meta import BatchMeta, StepIndex
from kvrelay.models.deepseek_v4.fusion import fused_glue
from kvrelay.models.deepseek_v4.layer import LayerKernels
from kvrelay.models.deepseek_v4.mhc import HyperConnection
from kvrelay.models.deepseek_v4.model import DeepseekV4ForCausalLM
from kvrelay.models.deepseek_v4.pooled_attention import AttentionOps, pooled_attention


def _glue(kernels: LayerKernels | None):
    """The Triton path compiles the glue between its kernels (not `--deterministic`'s)."""
    return fused_glue(kernels is not None and kernels.fuse_glue)


@torch.no_grad()
def forward_batched(
    model: DeepseekV4ForCausalLM,
    input_ids: torch.Tensor,
    meta: BatchMeta,
    pool,
    sample_rows: torch.Tensor,
    ops: AttentionOps,
    kernels: LayerKernels | None = None,
    profile: StepProfiler | None = None,
    head: bool = True,
    streams_out: list | None = None,
    index: StepIndex | None = None,
) -> torch.Tensor:
    """input_ids [T] -> logits [len(sample_rows), V] in the model dtype (without `head`: the
    final hidden states of those rows, which the LM head maps to logits). `kernels` are the fused
    replacements of the blocks' torch ops (None: torch). `streams_out`: gets every row's final
    streams [T, hc, hidden] appended (what the MTP block reads); `index`: the step's index
    tensors, when the caller shares them with the MTP pass (built here otherwise)."""
    m = model.model
    index = index or StepIndex(meta, m.config.sliding_window)
    with _glue(kernels):
        x = m.embed_tokens(input_ids)
        streams = x[:, None, :].expand(-1, m.config.hc_mult, -1).contiguous()
        fused_hc = (
            kernels is not None
            and kernels.hc_pre is not None
            and x.dtype != torch.float64
            and m.config.hc_mult == 4  # hc_pre's Sinkhorn is written for 4 streams
            and x.shape[0] <= kernels.hc_pre_max_tokens
        )
        pending = None
        for i, layer in enumerate(m.layers):

            def attend(xn: torch.Tensor, i: int = i, layer=layer) -> torch.Tensor:
                return pooled_attention(layer.self_attn, xn, i, meta, index, pool, ops)

            if fused_hc:
                streams, pending = layer.run_fused(
                    streams, pending, input_ids, attend, profile, kernels
                )
            else:
                streams = layer.run(streams, input_ids, attend, profile, kernels)
        if pending is not None:
            streams = HyperConnection.merge(pending[0], streams, pending[1], pending[2])
        if streams_out is not None:
            streams_out.append(streams)
        hidden = m.norm(m.hc_head(streams[sample_rows]))
        return model.compute_logits(hidden) if head else hidden


@torch.no_grad()
def mtp_batched(
    model: DeepseekV4ForCausalLM,
    streams: torch.Tensor,
    next_ids: torch.Tensor,
    meta: BatchMeta,
    index: StepIndex,
    pool,
    rows: torch.Tensor,
    ops: AttentionOps,
    kernels: LayerKernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP block over the step `meta` described: row t reads the main model's final
    streams at t and the embedding of token t+1 (`next_ids`), writes its window row (the pool's
    MTP rows, after the layers'), and the logits [len(rows), V] of `rows` predict token t+2;
    with them the block's output streams of `rows` (what a chained draft reads next).
    `index`: the step's (the main forward's) index tensors, computed once for both."""
    m = model.model
    mtp, layer = m.mtp[0], len(m.layers)
    with _glue(kernels):
        e = mtp.e_proj(mtp.enorm(m.embed_tokens(next_ids)))
        x = e[:, None, :] + mtp.h_proj(mtp.hnorm(streams))

        def attend(xn: torch.Tensor) -> torch.Tensor:
            return pooled_attention(mtp.self_attn, xn, layer, meta, index, pool, ops)

        x = mtp.run(x, next_ids, attend, None, kernels)[rows]
        return model.compute_logits(mtp.norm(mtp.hc_head(x))), x


@torch.no_grad()
def mtp_drafts(
    model: DeepseekV4ForCausalLM,
    streams: torch.Tensor,
    next_ids: torch.Tensor,
    meta: BatchMeta,
    index: StepIndex,
    pool,
    rows: torch.Tensor,
    valid: torch.Tensor,
    ops: AttentionOps,
    kernels: LayerKernels | None,
    k: int,
) -> torch.Tensor:
    """[len(rows), k] greedy drafts: the MTP block over the step's rows (`mtp_batched`), then
    k - 1 times again over one row per draft, chained: the row after the last one reads the
    block's own output streams and the draft just made, at the next position (DeepSeek-V3's
    and SGLang's way of drafting several tokens with one MTP block). Chained rows write the
    window rows of positions past the committed ones, which later steps overwrite; rows whose
    `valid` is False (graph padding) and positions past a request's pages write to the dummy
    page 0. No host sync: the whole chain can be captured in a CUDA graph."""
    logits, x = mtp_batched(model, streams, next_ids, meta, index, pool, rows, ops, kernels)
    drafts = [logits.argmax(dim=-1)]
    if k == 1 or rows.shape[0] == 0:
        return drafts[0][:, None].expand(-1, k)
    m = model.model
    mtp, layer = m.mtp[0], len(m.layers)
    ps, n = meta.page_size, rows.shape[0]
    seq = meta.seq[rows]
    extra = -(-(k - 1) // ps) + 1  # page-table columns the chained positions may reach
    table = torch.where(valid[:, None], meta.page_table[seq], 0)
    table = torch.cat((table, table.new_zeros(n, extra)), dim=1)
    first = meta.positions[rows]
    own = torch.arange(n, device=rows.device)
    with _glue(kernels):
        for j in range(1, k):
            step = BatchMeta(
                positions=first + j, seq=own, page_table=table, slots=own * 0,
                chunk_start=first + j, chunk_end=first + j + 1, tok_base=own, closers={},
                max_entries={}, page_size=ps,
            )  # fmt: skip
            step_index = StepIndex(step, m.config.sliding_window)
            ids = drafts[-1]
            e = mtp.e_proj(mtp.enorm(m.embed_tokens(ids)))
            x = e[:, None, :] + mtp.h_proj(mtp.hnorm(x))

            def attend(xn: torch.Tensor, step=step, step_index=step_index) -> torch.Tensor:
                return pooled_attention(mtp.self_attn, xn, layer, step, step_index, pool, ops)

            x = mtp.run(x, ids, attend, None, kernels)
            drafts.append(model.compute_logits(mtp.norm(mtp.hc_head(x))).argmax(dim=-1))
    return torch.stack(drafts, dim=1)
