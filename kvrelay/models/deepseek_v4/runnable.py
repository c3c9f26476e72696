"""DeepSeek-V4's side of the runner contract (models/base.py): its paged cache pools and state
slots, the batched forward (torch ops, or Triton kernels on the GPU) or, with
`--attention-backend reference`, the per-sequence oracle path, and the decode graphs."""

from __future__ import annotations

import logging
import sys
from functools import partial

import torch

from kvrelay.cache.spec import CacheSpec
from kvrelay.config import EngineConfig
from kvrelay.layers.parallel import TPGroup
from kvrelay.models.base import Scheduled
from kvrelay.models.deepseek_v4.batch_meta import StepIndex, build_meta
from kvrelay.models.deepseek_v4.batched import forward_batched, mtp_drafts
from kvrelay.models.deepseek_v4.cache_pool import DeepseekV4CachePool
from kvrelay.models.deepseek_v4.cache_spec import dsv4_cache_spec, dsv4_page_size
from kvrelay.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config
from kvrelay.models.deepseek_v4.fp8_linears import use_fp8_linears
from kvrelay.models.deepseek_v4.fused_projections import fuse_projections
from kvrelay.models.deepseek_v4.layer import LayerKernels
from kvrelay.models.deepseek_v4.norms import use_norm_kernel
from kvrelay.models.deepseek_v4.paged import PagedSequence, forward_paged
from kvrelay.models.deepseek_v4.pooled_attention import AttentionOps
from kvrelay.models.deepseek_v4.step import Dsv4Step, from_wire, plan_step

log = logging.getLogger("kvrelay.runner")


class DeepseekV4Runnable:
    # A rejected draft's KV rows, compressed entries and index keys lie past the committed
    # length and are overwritten; its compressor-window rows land on state-slot rows nobody
    # reads before their positions are computed again (two windows a slot, K <= the smallest
    # ratio: cache_pool.py).
    speculation = "overwrite"
    drafts_with_mtp = True  # --speculative-algorithm mtp: its MTP block drafts (propose_drafts)

    def __init__(
        self, cfg: EngineConfig, model_cfg: DeepseekV4Config, model, device: torch.device,
        dtype: torch.dtype, tp: TPGroup,
    ) -> None:  # fmt: skip
        self.cfg, self.model_cfg, self.model = cfg, model_cfg, model
        self.device, self.dtype, self.tp = device, dtype, tp
        c = model_cfg
        self.page_size = dsv4_page_size(c, cfg.cache.page_size)
        # Admission keeps running requests <= max_running_requests, so a slot is always free.
        self.num_state_slots = cfg.scheduler.max_running_requests + 1  # slot 0 is never handed out
        self.layer_hook = None  # benchmarks of the reference path: called before each layer
        self.reference = cfg.attention_backend == "reference"
        self.ratios = _compress_ratios(c)
        self.ops: AttentionOps | None = None
        self.kernels: LayerKernels | None = None
        self.pool: DeepseekV4CachePool | None = None
        # --speculative-algorithm mtp: the MTP block runs over every step's rows (its window
        # rows in the pool) once the step's tokens are committed, and drafts the next token
        self.mtp = cfg.speculative.algorithm == "mtp"
        # the last step's MTP pass: (its step, a function of (next_ids, draft rows) -> logits)
        self._drafts: tuple[Dsv4Step, object] | None = None

    @staticmethod
    def check(cfg: EngineConfig, model_cfg: DeepseekV4Config, device: torch.device) -> None:
        check_parallel(cfg, device)
        ratios = _compress_ratios(model_cfg)
        k = cfg.speculative.num_draft_tokens
        if cfg.speculative.algorithm != "none" and ratios and k > min(ratios):
            # a state slot keeps two windows: a verify step's rows must not span more
            raise ValueError(
                f"--speculative-num-draft-tokens {k}: DeepSeek-V4 verifies at most "
                f"{min(ratios)} drafts a step (its smallest compress ratio)"
            )
        if cfg.speculative.algorithm == "mtp":
            if cfg.attention_backend == "reference":
                raise ValueError("--speculative-algorithm mtp runs on the batched path: not with "
                                 "--attention-backend reference")  # fmt: skip
            if model_cfg.num_nextn_predict_layers < 1:
                raise ValueError("--speculative-algorithm mtp: the model config has no MTP block")

    def cache_spec(self) -> CacheSpec:
        return dsv4_cache_spec(
            self.model_cfg, self.page_size, self.dtype, self.cfg.cache.index_k_dtype, int(self.mtp)
        )

    def reserve_bytes(self) -> int:
        c = self.model_cfg
        return self.cfg.scheduler.max_num_batched_tokens * (
            c.hidden_size * c.hc_mult * 16 + c.vocab_size * 4
        )

    def build_pool(self, num_pages: int) -> DeepseekV4CachePool:
        # The pools are the same on every rank (one shared KV head): the same page ids everywhere.
        self.pool = DeepseekV4CachePool(
            self.model_cfg, num_pages, self.page_size, self.num_state_slots, self.dtype,
            self.device, self.cfg.cache.index_k_dtype, int(self.mtp),
        )  # fmt: skip
        return self.pool

    @property
    def cache(self) -> DeepseekV4CachePool:
        return self.pool

    def prepare_kernels(self) -> None:
        """FP8 linears, then the attention ops and (Triton) fused norms and projections."""
        cfg = self.cfg
        if cfg.linear_weights == "fp8":
            n = use_fp8_linears(self.model)
            log.info("%d attention / shared-expert linears hold FP8 block-scaled weights", n)
        self.ops, self.kernels = _pick_ops(cfg.attention_backend, self.device, cfg.deterministic)
        if self.kernels is not None:  # the Triton path: fused norms and projections as well
            from kvrelay.kernels.triton_pointwise import rms_norm_wide

            use_norm_kernel(self.model, rms_norm_wide)
            fuse_projections(self.model)

    def prepare(self, batch: list[Scheduled], all_rows: bool, prompt_rows: list[int]) -> Dsv4Step:
        # Prompt-logprob rows ride along: the forward returns their hidden states too.
        return plan_step(batch, all_rows, prompt_rows)

    def from_wire(self, header: list[int], payload: torch.Tensor) -> Dsv4Step:
        return from_wire(header, payload)

    def forward(self, step: Dsv4Step, profile) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(float32 logits of the sampled rows, final hidden states of the prompt rows)."""
        input_ids = torch.tensor(step.ids, dtype=torch.long).to(self.device, non_blocking=True)
        rows_t = torch.tensor(step.rows, dtype=torch.long).to(self.device, non_blocking=True)
        if self.reference:
            hidden = self._hidden_reference(step, input_ids, rows_t, profile)
        else:
            meta = build_meta(
                step.starts, step.counts, step.pages, step.slots, self.ratios, self.page_size,
                self.device,
            )  # fmt: skip
            streams = [] if self.mtp else None
            index = StepIndex(meta, self.model_cfg.sliding_window)  # shared with the MTP pass
            hidden = forward_batched(
                self.model, input_ids, meta, self.pool, rows_t, self.ops, self.kernels, profile,
                head=False, streams_out=streams, index=index,
            )  # fmt: skip
            if self.mtp:
                self.drafts_from(step, self._eager_drafts(streams[0], meta, index))
        logits = self.model.compute_logits(hidden[: step.n_sampled]).float()
        return logits, hidden[step.n_sampled :]

    def _eager_drafts(self, streams: torch.Tensor, meta, index: StepIndex):
        def draft(next_ids: list[int], rows: list[int]) -> torch.Tensor:
            dev = self.device
            ids_t = torch.tensor(next_ids, dtype=torch.long).to(dev, non_blocking=True)
            rows_t = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
            valid = torch.ones(len(rows), dtype=torch.bool, device=dev)
            return mtp_drafts(
                self.model, streams, ids_t, meta, index, self.pool, rows_t, valid, self.ops,
                self.kernels, self.cfg.speculative.num_draft_tokens,
            )  # fmt: skip

        return draft

    def drafts_from(self, step: Dsv4Step, draft) -> None:
        """mtp: `draft(next_ids, rows)` runs the MTP block over `step`'s rows (eagerly, or the
        graph of the step's key) once its tokens are committed (`propose_drafts`)."""
        self._drafts = (step, draft)

    def make_graphs(self, max_batch: int, max_model_len: int):
        """Decode and verify graphs per (batch, tokens per request, context) bucket, captured
        on first use (Triton path only); with mtp, each with its MTP pass."""
        if self.kernels is None:
            return None
        from kvrelay.models.deepseek_v4.graphs import Dsv4GraphRunner

        max_q = self.cfg.speculative.rows_per_request
        return Dsv4GraphRunner(self, max_batch, max_model_len, max_q)

    def before_step(self, batch: list[Scheduled]) -> None:
        """A request's first step after a prefix cache hit: its state slot never saw the shared
        tokens, so it takes the compressor state kept with the last shared page."""
        p = self.page_size
        for s in batch:
            r = s.req
            if r.matched_tokens and r.num_computed == r.matched_tokens:
                page = r.pages[r.matched_tokens // p - 1]
                self.pool.restore_slot(r.state_slot, page, r.matched_tokens)

    def propose_drafts(
        self, batch: list[Scheduled], follow: dict[str, tuple[int, int]], wants: set[str]
    ) -> None:
        """mtp, after the step's tokens are committed: the MTP block over the step's rows (row
        t with token t+1: the next row's, or for a request's last committed row `follow[rid]`
        = (tokens of the step committed, the token after them); after a prompt chunk, the
        prompt's next token). Each request in `wants` gets the draft of its last committed row
        (req.mtp_draft, for when it has as many tokens as now). Rows past a request's committed
        ones (rejected drafts) write window rows that later steps overwrite."""
        if self._drafts is None:
            return
        step, draft = self._drafts
        self._drafts = None
        nxt = step.ids[1:] + [0]
        rows, owners, first = [], [], 0
        for s, start, count in zip(batch, step.starts, step.counts, strict=True):
            req = s.req
            if req.rid in follow:
                committed, token = follow[req.rid]
                nxt[first + committed - 1] = token
                if req.rid in wants:
                    rows.append(first + committed - 1)
                    owners.append(req)
            else:  # a prompt chunk: the prompt goes on (nothing after a prompt-only request)
                after = req.token_slice(start + count, start + count + 1)
                nxt[first + count - 1] = after[0] if after else 0
            first += count
        drafts = draft(nxt, rows)  # [len(rows), k]
        for req, d in zip(owners, drafts.tolist(), strict=True):
            req.mtp_draft, req.mtp_draft_at = d, req.num_tokens

    def warm_up(self, graphs) -> None:
        from kvrelay.models.deepseek_v4.warm_up import warm_up

        warm_up(
            self, graphs
        )  # compiled before ready: a first burst must not wait for torch.compile

    def describe(self) -> str:
        c = self.cfg
        return (
            f"model=deepseek_v4 slots={self.num_state_slots - 1} index_k={c.cache.index_k_dtype} "
            f"expert_parallel={c.expert_parallel} ep_dispatch={c.ep_dispatch}"
        )

    def _hidden_reference(self, step: Dsv4Step, input_ids, rows_t, profile) -> torch.Tensor:
        """The oracle path (per-sequence attention): final hidden states of the rows `rows_t`."""
        seqs: list[PagedSequence] = []
        first = 0
        for start, count, pages, slot in zip(
            step.starts, step.counts, step.pages, step.slots, strict=True
        ):
            table = torch.tensor(pages, dtype=torch.long, device=self.device)
            seqs.append(PagedSequence(slice(first, first + count), start, table, slot))
            first += count
        return forward_paged(
            self.model, input_ids, seqs, self.pool, rows_t, self.layer_hook, profile, head=False
        )


def _compress_ratios(c: DeepseekV4Config) -> tuple[int, ...]:
    return tuple(
        sorted({c.compress_ratio(i) for i, t in enumerate(c.layer_types) if t in (CSA, HCA)})
    )


def check_parallel(cfg: EngineConfig, device: torch.device) -> None:
    """DeepSeek-V4 TP/EP runs the torch path on the CPU (gloo) only, so far: refuse the rest."""
    if cfg.speculative.algorithm != "none" and cfg.tensor_parallel_size > 1:
        raise ValueError(
            "speculative decoding is not supported for DeepSeek-V4 with tensor parallel yet "
            "(the other ranks follow plain steps only)"
        )
    if cfg.expert_parallel and cfg.tensor_parallel_size < 2:
        raise ValueError("--expert-parallel needs --tensor-parallel-size 2 or more")
    if cfg.ep_dispatch != "all-reduce" and not cfg.expert_parallel:
        raise ValueError(f"--ep-dispatch {cfg.ep_dispatch} needs --expert-parallel")
    if cfg.tensor_parallel_size == 1:
        return
    if device.type != "cpu" or cfg.attention_backend == "triton":
        raise ValueError(
            "DeepSeek-V4 tensor/expert parallel runs on the CPU (torch or reference attention "
            "backend) only, so far: the Triton kernels and CUDA graphs are single-rank"
        )
    if cfg.linear_weights != "auto":
        raise ValueError(f"--linear-weights {cfg.linear_weights} is not supported with TP yet")
    # Every rank holds the whole cache (one shared KV head): rank 0 alone sends a prefill's cache,
    # and a decode server's rank 0 hands each received piece to every rank (tp_install.py).


def _pick_ops(
    backend: str, device: torch.device, deterministic: bool = False
) -> tuple[AttentionOps, LayerKernels | None]:
    """Torch references (CPU, `torch`), the Triton kernels (`triton`; auto on the GPU), or the
    batch-invariant torch ops (`deterministic` on the CPU).

    `deterministic` on the GPU (issue 22): the Triton kernels, each with a schedule that no row
    count chooses, so a row's bits do not depend on its batch:
    - sparse MQA in one split per row (the split count follows the row count otherwise);
    - the fused MoE at one tile config (`default_config` follows the tokens per expert);
    - the mHC pre kernel at every step size (its slices over the hidden dim are fixed; the
      gates kernel it hands long prefill steps to goes with the compiled mix and collapse);
    - the indexer (its tiles follow the head count and dims only; the top-k set is exact, in
      entry order) and the compressor's pooling (one program per window) as they are;
    - the glue eager (`fuse_glue=False`), under the batch-invariant dispatch mode.
    Decode and prefill rows run the same kernels; the dense linears meet the invariant linear
    through the mode (layers/batch_invariant.py)."""
    from kvrelay.kernels.indexer_reference import indexer_topk_reference
    from kvrelay.models.deepseek_v4.sparse_attention import sparse_mqa_reference

    if deterministic and device.type != "cuda":
        from kvrelay.layers import batch_invariant_attention as bi

        return AttentionOps(bi.sparse_mqa, bi.indexer_topk), None
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        from kvrelay.kernels.triton_compressor import pool_windows
        from kvrelay.kernels.triton_indexer import indexer_topk
        from kvrelay.kernels.triton_mhc import PRE_MAX_TOKENS, hc_gates, hc_pre
        from kvrelay.kernels.triton_moe import INVARIANT_CONFIG, fused_experts
        from kvrelay.kernels.triton_sparse_attention import sparse_mqa

        if deterministic:
            ops = AttentionOps(partial(sparse_mqa, num_splits=1), indexer_topk, pool_windows)
            experts = partial(fused_experts, config=INVARIANT_CONFIG)
            return ops, LayerKernels(experts, None, hc_pre, sys.maxsize, fuse_glue=False)
        ops = AttentionOps(sparse_mqa, indexer_topk, pool_windows)
        return ops, LayerKernels(fused_experts, hc_gates, hc_pre, PRE_MAX_TOKENS)
    return AttentionOps(sparse_mqa_reference, indexer_topk_reference), None
