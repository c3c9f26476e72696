"""Runs DeepSeek-V4 for a scheduled batch: its paged cache pools, state slots and the torch
reference forward (no CUDA graphs yet; the kernels come later)."""

from __future__ import annotations

import logging

import torch

from kvrelay.cache.dsv4_pool import DeepseekV4CachePool, dsv4_page_size
from kvrelay.cache.page_allocator import PageAllocator, pages_for
from kvrelay.config import EngineConfig
from kvrelay.disagg.layout import PAGE, SLOT, CacheKind
from kvrelay.engine.runner import cache_budget, pick_device, pick_dtype
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.layers.step_profile import StepProfiler
from kvrelay.models.deepseek_v4.paged import PagedSequence, forward_paged
from kvrelay.weights.loader import ModelSource, build_model

log = logging.getLogger("kvrelay.runner")


class DeepseekV4Runner:
    def __init__(self, cfg: EngineConfig, src: ModelSource) -> None:
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        c = self.model_cfg = src.config
        self.page_size = dsv4_page_size(c, cfg.cache.page_size)
        torch.manual_seed(cfg.seed)
        self.model = build_model(src, self.dtype, self.device, cfg.seed)
        num_slots = cfg.scheduler.max_running_requests + 1  # slot 0 is never handed out
        num_pages = self._num_pages(num_slots)
        self.cache = DeepseekV4CachePool(
            c, num_pages, self.page_size, num_slots, self.dtype, self.device,
            cfg.cache.index_k_dtype,
        )  # fmt: skip
        self.allocator = PageAllocator(num_pages)
        self.layer_hook = None  # benchmarks: called before each layer (and after the last)
        # Admission keeps running requests <= max_running_requests, so a slot is always free.
        self.state_slots = PageAllocator(num_slots)
        pool_tokens = (num_pages - 1) * self.page_size
        self.max_model_len = min(cfg.max_model_len or c.max_position_embeddings, pool_tokens)
        log.info(
            "runner ready model=deepseek_v4 device=%s dtype=%s pages=%d page_size=%d "
            "slots=%d max_model_len=%d index_k=%s",
            self.device, self.dtype, num_pages, self.page_size, num_slots - 1,
            self.max_model_len, cfg.cache.index_k_dtype,
        )  # fmt: skip

    def _num_pages(self, num_slots: int) -> int:
        c = self.model_cfg
        if self.cfg.cache.max_total_tokens:
            return pages_for(self.cfg.cache.max_total_tokens, self.page_size) + 1
        slots = num_slots * DeepseekV4CachePool.bytes_per_slot(c, self.dtype)
        act = self.cfg.scheduler.max_num_batched_tokens * (
            c.hidden_size * c.hc_mult * 16 + c.vocab_size * 4
        )
        budget = cache_budget(self.cfg, self.device, act) - slots
        per_page = DeepseekV4CachePool.bytes_per_page(c, self.page_size, self.dtype)
        return max(int(budget // per_page), 2)

    def transfer_layout(self) -> list[CacheKind]:
        """Every tensor of the pool, described for a PD transfer: the window KV (only its last
        window - 1 tokens are read again), compressed entries and index keys (a row per
        `ratio` tokens), and the compressors' per-request state slots."""
        pool = self.cache
        slot_tensors = {
            id(t)
            for s in pool.comp_slots + pool.index_slots
            if s is not None
            for t in (s.pending_kv, s.pending_score, s.prev_kv, s.prev_score)
            if t is not None
        }
        kinds = []
        for name, t in pool.kinds.items():
            layer = int(name.split(".", 1)[0][1:])  # "L{i}.…"
            if id(t) in slot_tensors:
                kinds.append(CacheKind(name, t, SLOT, layer))
            elif t is pool.swa[layer]:
                kinds.append(CacheKind(name, t, PAGE, layer, keep_last=pool.window - 1))
            else:
                kinds.append(CacheKind(name, t, PAGE, layer, ratio=self.page_size // t.shape[1]))
        return kinds

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
        ids: list[int] = []
        seqs: list[PagedSequence] = []
        sample_rows: list[int] = []
        for s in batch:
            r, start = s.req, s.req.num_computed
            rows = slice(len(ids), len(ids) + s.num_new_tokens)
            ids += r.token_slice(start, start + s.num_new_tokens)
            pages = torch.tensor(r.pages, dtype=torch.long, device=self.device)
            seqs.append(PagedSequence(rows, start, pages, r.state_slot))
            if all_rows:
                sample_rows += range(rows.start, rows.stop)
            elif s.samples:
                sample_rows.append(rows.stop - 1)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        rows_t = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = forward_paged(
            self.model, input_ids, seqs, self.cache, rows_t, self.layer_hook, profile
        )
        return logits.float()
