"""Runs DeepSeek-V4 for a scheduled batch: its paged cache pools, state slots, and the batched
forward (torch ops, or Triton kernels on the GPU) — or, with `--attention-backend reference`,
the per-sequence oracle path."""

from __future__ import annotations

import logging

import torch

from kvrelay.cache.paging import pages_for
from kvrelay.cache.spec import CacheKind, cache_kinds
from kvrelay.config import EngineConfig
from kvrelay.engine import prompt_logprobs, tp_install
from kvrelay.engine.dsv4_step import HEADER, Dsv4Step, plan_step, recv_step, send_step, send_stop
from kvrelay.engine.dsv4_warm_up import warm_up
from kvrelay.engine.prompt_logprobs import PromptRows, StepLogits
from kvrelay.engine.runner import cache_budget, pick_device, pick_dtype
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.layers import batch_invariant
from kvrelay.layers.parallel import TPGroup
from kvrelay.layers.step_profile import StepProfiler
from kvrelay.models.deepseek_v4.batch_meta import build_meta
from kvrelay.models.deepseek_v4.batched import forward_batched
from kvrelay.models.deepseek_v4.cache_pool import DeepseekV4CachePool
from kvrelay.models.deepseek_v4.cache_spec import dsv4_cache_spec, dsv4_page_size
from kvrelay.models.deepseek_v4.config import CSA, HCA
from kvrelay.models.deepseek_v4.fp8_linears import use_fp8_linears
from kvrelay.models.deepseek_v4.fused_projections import fuse_projections
from kvrelay.models.deepseek_v4.layer import LayerKernels
from kvrelay.models.deepseek_v4.norms import use_norm_kernel
from kvrelay.models.deepseek_v4.paged import PagedSequence, forward_paged
from kvrelay.models.deepseek_v4.pooled_attention import AttentionOps
from kvrelay.weights.dsv4_rank_load import load_rank
from kvrelay.weights.dsv4_tp import shard_model
from kvrelay.weights.loader import ModelSource, build_model

log = logging.getLogger("kvrelay.runner")


class DeepseekV4Runner:
    def __init__(self, cfg: EngineConfig, src: ModelSource) -> None:
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        check_parallel(cfg, self.device)
        batch_invariant.check_supported(cfg, self.device)  # refuses what it cannot make invariant
        # Tensor parallel: torch.distributed is already initialised by whoever started the rank.
        self.tp = TPGroup.from_default(cfg.tensor_parallel_size)
        c = self.model_cfg = src.config
        self.page_size = dsv4_page_size(c, cfg.cache.page_size)
        torch.manual_seed(cfg.seed)
        a2a = cfg.ep_dispatch == "all-to-all"
        if self.tp.is_parallel and src.kind == "hf":  # read only this rank's slices
            self.model = load_rank(
                src.path, c, self.dtype, self.device, self.tp, cfg.expert_parallel,
                ep_all_to_all=a2a,
            )  # fmt: skip
        else:  # built whole (dummy weights: those of TP=1), then cut to this rank's part
            self.model = build_model(src, self.dtype, self.device, cfg.seed)
            shard_model(self.model, self.tp, cfg.expert_parallel, a2a)
        num_slots = cfg.scheduler.max_running_requests + 1  # slot 0 is never handed out
        # The pools are the same on every rank (one shared KV head): the same page ids everywhere.
        num_pages = self.tp.min_int(self._num_pages(num_slots))
        self.pool = DeepseekV4CachePool(
            c, num_pages, self.page_size, num_slots, self.dtype, self.device,
            cfg.cache.index_k_dtype,
        )  # fmt: skip
        self.num_pages = num_pages  # the scheduler hands them out (page 0 never)
        self._kinds: list[CacheKind] | None = None  # transfer_layout(), for PD decode installs
        self.layer_hook = None  # benchmarks of the reference path: called before each layer
        self.reference = cfg.attention_backend == "reference"
        self.ratios = tuple(
            sorted({c.compress_ratio(i) for i, t in enumerate(c.layer_types) if t in (CSA, HCA)})
        )
        if cfg.linear_weights == "fp8":
            n = use_fp8_linears(self.model)
            log.info("%d attention / shared-expert linears hold FP8 block-scaled weights", n)
        self.ops, self.kernels = _pick_ops(cfg.attention_backend, self.device, cfg.deterministic)
        if self.kernels is not None:  # the Triton path: fused norms and projections as well
            from kvrelay.kernels.triton_pointwise import rms_norm_wide

            use_norm_kernel(self.model, rms_norm_wide)
            fuse_projections(self.model)
        # Admission keeps running requests <= max_running_requests, so a slot is always free.
        self.num_state_slots = num_slots  # the scheduler hands them out (slot 0 never)
        pool_tokens = (num_pages - 1) * self.page_size
        self.max_model_len = min(cfg.max_model_len or c.max_position_embeddings, pool_tokens)
        self.graphs = None
        if self.device.type == "cuda" and cfg.cuda_graphs and self.kernels is not None:
            from kvrelay.engine.dsv4_graphs import Dsv4GraphRunner

            self.graphs = Dsv4GraphRunner(self, cfg.max_cuda_graph_batch, self.max_model_len)
        warm_up(self)  # compiled before ready: a first burst must not wait for torch.compile
        log.info(
            "runner ready model=deepseek_v4 device=%s dtype=%s pages=%d page_size=%d "
            "slots=%d max_model_len=%d index_k=%s tp_rank=%d/%d expert_parallel=%s ep_dispatch=%s",
            self.device, self.dtype, num_pages, self.page_size, num_slots - 1,
            self.max_model_len, cfg.cache.index_k_dtype, self.tp.rank, self.tp.world,
            cfg.expert_parallel, cfg.ep_dispatch,
        )  # fmt: skip

    def _num_pages(self, num_slots: int) -> int:
        c = self.model_cfg
        if self.cfg.cache.max_total_tokens:
            return pages_for(self.cfg.cache.max_total_tokens, self.page_size) + 1
        spec = dsv4_cache_spec(c, self.page_size, self.dtype, self.cfg.cache.index_k_dtype)
        slots = num_slots * spec.bytes_per_slot
        act = self.cfg.scheduler.max_num_batched_tokens * (
            c.hidden_size * c.hc_mult * 16 + c.vocab_size * 4
        )
        budget = cache_budget(self.cfg, self.device, act) - slots
        per_page = spec.bytes_per_page
        return max(int(budget // per_page), 2)

    def transfer_layout(self) -> list[CacheKind]:
        """Every tensor of the pool, as its cache spec declares it for a PD transfer."""
        return cache_kinds(self.pool)

    @property
    def cache(self) -> DeepseekV4CachePool:
        return self.pool

    @torch.inference_mode()
    def forward(
        self,
        batch: list[ScheduledRequest],
        profile: StepProfiler | None = None,
        all_rows: bool = False,
    ) -> torch.Tensor:
        """Logits [N, V] (float32) of the batch's sampling rows in order (every row if
        `all_rows`: tests compare whole chunks with the full-sequence forward); `profile` times
        the step's components."""
        return self._run(batch, profile, all_rows, None).logits

    @torch.inference_mode()
    def forward_step(
        self, batch: list[ScheduledRequest], profile: StepProfiler | None = None
    ) -> StepLogits:
        """The sampling rows' logits, and the prompt logprobs of the requests that ask for them
        (their rows' hidden states from the same forward, through the head)."""
        return self._run(batch, profile, False, prompt_logprobs.plan(batch))

    def _run(self, batch, profile, all_rows: bool, rows: PromptRows | None) -> StepLogits:
        with batch_invariant.scope(self.cfg.deterministic):
            return self._run_batch(batch, profile, all_rows, rows)

    def _run_batch(self, batch, profile, all_rows: bool, rows: PromptRows | None) -> StepLogits:
        self._restore_after_prefix_hit(batch)
        if rows is None and self._graphable(batch, profile, all_rows):
            logits = self.graphs.run(
                [s.req.token_slice(s.req.num_computed, s.req.num_computed + 1)[0] for s in batch],
                [s.req.num_computed for s in batch],
                [s.req.pages for s in batch],
                [s.req.state_slot for s in batch],
            )
            return StepLogits(logits.float(), [])
        # Prompt-logprob rows ride along: the forward returns their hidden states too.
        step = plan_step(batch, all_rows, rows.rows if rows is not None else [])
        if self.tp.is_parallel:
            if rows is not None:  # raised before the followers hear of this step
                raise NotImplementedError("prompt logprobs are not supported with tensor parallel")
            send_step(step, self.tp, self.device)
        logits, hidden = self._forward_step(step, profile)
        if rows is None:
            return StepLogits(logits, [])
        vocab = self.model_cfg.vocab_size
        head = self.model.compute_logits
        return StepLogits(
            logits, prompt_logprobs.score(hidden[step.n_sampled :], head, vocab, rows)
        )

    def _forward_step(self, step: Dsv4Step, profile) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits of the sampled rows, final hidden states of every wanted row)."""
        input_ids = torch.tensor(step.ids, dtype=torch.long).to(self.device, non_blocking=True)
        rows_t = torch.tensor(step.rows, dtype=torch.long).to(self.device, non_blocking=True)
        if self.reference:
            hidden = self._hidden_reference(step, input_ids, rows_t, profile)
        else:
            meta = build_meta(
                step.starts, step.counts, step.pages, step.slots, self.ratios, self.page_size,
                self.device,
            )  # fmt: skip
            hidden = forward_batched(
                self.model, input_ids, meta, self.pool, rows_t, self.ops, self.kernels, profile,
                head=False,
            )  # fmt: skip
        return self.model.compute_logits(hidden[: step.n_sampled]).float(), hidden

    def install_piece(self, piece: tp_install.InstallPiece) -> None:
        """A PD decode server: install a received KV piece on every rank (each holds the whole
        cache)."""
        tp_install.install_everywhere(
            self.tp, self.device, HEADER, self._layout(), self.page_size, piece
        )

    def _layout(self) -> list[CacheKind]:
        if self._kinds is None:
            self._kinds = self.transfer_layout()
        return self._kinds

    def follow(self) -> None:
        """Ranks > 0 of tensor parallel: run each step rank 0 broadcasts until it says stop."""
        with torch.inference_mode():
            while (step := recv_step(self.tp, self.device)) is not None:
                if isinstance(step, tp_install.InstallPiece):
                    tp_install.install(self._layout(), self.page_size, step)
                else:
                    self._forward_step(step, None)

    def stop_followers(self) -> None:
        """Rank 0: end the followers' `follow` loops."""
        if self.tp.is_parallel and self.tp.rank == 0:
            send_stop(self.tp, self.device)

    def _restore_after_prefix_hit(self, batch: list[ScheduledRequest]) -> None:
        """A request's first step after a prefix cache hit: its state slot never saw the shared
        tokens, so it takes the compressor state kept with the last shared page."""
        p = self.page_size
        for s in batch:
            r = s.req
            if r.matched_tokens and r.num_computed == r.matched_tokens:
                self.pool.restore_slot(r.state_slot, r.pages[r.matched_tokens // p - 1])

    def _graphable(self, batch, profile, all_rows: bool) -> bool:
        """A decode step (one sampled token per request) that a captured graph covers; profiled
        steps run eagerly so their components can be timed."""
        return (
            self.graphs is not None
            and profile is None
            and not all_rows
            and all(s.num_new_tokens == 1 and s.samples for s in batch)
            and self.graphs.can_run(max(s.req.num_computed for s in batch) + 1, len(batch))
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


def check_parallel(cfg: EngineConfig, device: torch.device) -> None:
    """DeepSeek-V4 TP/EP runs the torch path on the CPU (gloo) only, so far: refuse the rest."""
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
    batch-invariant torch ops (`deterministic`)."""
    from kvrelay.kernels.indexer_reference import indexer_topk_reference
    from kvrelay.models.deepseek_v4.sparse_attention import sparse_mqa_reference

    if deterministic:
        from kvrelay.layers import batch_invariant_attention as bi

        return AttentionOps(bi.sparse_mqa, bi.indexer_topk), None
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        from kvrelay.kernels.triton_compressor import pool_windows
        from kvrelay.kernels.triton_indexer import indexer_topk
        from kvrelay.kernels.triton_mhc import hc_gates
        from kvrelay.kernels.triton_moe import fused_experts
        from kvrelay.kernels.triton_sparse_attention import sparse_mqa

        ops = AttentionOps(sparse_mqa, indexer_topk, pool_windows)
        return ops, LayerKernels(fused_experts, hc_gates)
    return AttentionOps(sparse_mqa_reference, indexer_topk_reference), None
