"""Owns the model, the KV tensors and the CUDA graphs; runs one forward pass for a scheduled batch.

Which pages are in use is the scheduler's business: the runner only says how many its tensors hold.
"""

from __future__ import annotations

import logging
import os

import torch

from kvrelay.cache.kv_pool import KVPool, kv_cache_spec
from kvrelay.cache.paging import pages_for
from kvrelay.cache.spec import CacheKind, CacheSpec, cache_kinds
from kvrelay.config import EngineConfig
from kvrelay.engine import prompt_logprobs, tp_gather, tp_install, tp_step
from kvrelay.engine.batch import ForwardBatch, prepare
from kvrelay.engine.prompt_logprobs import StepLogits
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.layers import batch_invariant
from kvrelay.layers.attention import make_backend
from kvrelay.layers.batch_invariant_attention import BatchInvariantAttention
from kvrelay.layers.ops import TORCH_OPS, triton_ops
from kvrelay.layers.parallel import TPGroup
from kvrelay.layers.step_profile import StepProfiler
from kvrelay.models import registry
from kvrelay.models.llama import ForwardContext
from kvrelay.weights.loader import ModelSource, build_model

log = logging.getLogger("kvrelay.runner")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def cache_budget(cfg: EngineConfig, device: torch.device, reserve: int) -> float:
    """Bytes the caches may take: a fraction of free GPU memory (less `reserve` for
    activations), or of available RAM on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * cfg.cache.memory_fraction - reserve
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(avail * 0.3 * cfg.cache.memory_fraction, 8 << 30)


def make_runner(cfg: EngineConfig, src: ModelSource):
    """The runner the model's family names in the registry (dense: paged KV, CUDA graphs)."""
    return registry.family(src.config.architecture).load("runner")(cfg, src)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, src: ModelSource) -> None:
        if cfg.linear_weights != "auto":
            raise ValueError(
                f"--linear-weights {cfg.linear_weights} is for DeepSeek-V4 models; "
                f"{src.config.architecture} runs its weights in the model dtype"
            )
        if cfg.expert_parallel or cfg.ep_dispatch != "all-reduce":
            raise ValueError("--expert-parallel and --ep-dispatch are for DeepSeek-V4 (MoE) models")
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        self.page_size = cfg.cache.page_size
        torch.manual_seed(cfg.seed)
        # Tensor parallel: torch.distributed is already initialised by whoever started the rank.
        self.tp = TPGroup.from_default(cfg.tensor_parallel_size)
        self.model = build_model(
            src, self.dtype, self.device, cfg.seed, cfg.max_model_len or 1 << 17, self.tp
        )
        self.model_cfg = src.config
        self._kinds: list[CacheKind] | None = None  # transfer_layout(), for PD decode installs
        self.num_state_slots = 0  # dense models keep no per-request state outside the KV pages
        backend = cfg.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        elif backend == "reference":  # DeepSeek-V4's oracle path; dense: the torch reference
            backend = "torch"
        self.backend = make_backend(backend)
        batch_invariant.check_supported(cfg, self.device)  # refuses what it cannot make invariant
        if cfg.deterministic:
            self.backend = BatchInvariantAttention()
        # The Triton backend also brings the fused per-token kernels; "torch" is the reference.
        self.ops = triton_ops() if backend == "triton" else TORCH_OPS
        num_pages = self.tp.min_int(self._num_pages())  # every rank holds the same page ids
        self.pool = KVPool(self._cache_spec(), num_pages, self.device)
        self.num_pages = num_pages  # page 0 included (the dummy page padded rows write to)
        pool_tokens = (num_pages - 1) * self.page_size
        self.max_model_len = min(
            cfg.max_model_len or self.model_cfg.max_position_embeddings, pool_tokens
        )
        self.graphs = None
        if self.device.type == "cuda" and cfg.cuda_graphs and not self.tp.is_parallel:
            from kvrelay.engine.cuda_graphs import CudaGraphRunner

            max_pages = pages_for(self.max_model_len, self.page_size)
            self.graphs = CudaGraphRunner(
                self.model,
                self.pool.layers,
                self.backend,
                self.ops,
                cfg.max_cuda_graph_batch,
                max_pages,
                self.device,
                profiled=cfg.step_profile_every > 0,
            )
        log.info(
            "runner ready device=%s dtype=%s backend=%s kv_pages=%d page_size=%d max_model_len=%d cuda_graphs=%s",
            self.device,
            self.dtype,
            backend,
            num_pages,
            self.page_size,
            self.max_model_len,
            self.graphs is not None,
        )

    def _num_pages(self) -> int:
        if self.cfg.cache.max_total_tokens:
            return pages_for(self.cfg.cache.max_total_tokens, self.page_size) + 1
        # Leave room for activations of a full prefill step and for the decode graphs' logits.
        c = self.model_cfg
        act = self.cfg.scheduler.max_num_batched_tokens * (c.hidden_size * 16 + c.vocab_size * 4)
        graphs = 2 * self.cfg.max_cuda_graph_batch * c.vocab_size * 4
        budget = cache_budget(self.cfg, self.device, act + graphs)
        per_page = self._cache_spec().bytes_per_page
        return max(int(budget // per_page), 2)

    def _cache_spec(self) -> CacheSpec:
        """Each layer's paged K and V: with TP, this rank's shard of the KV heads."""
        c, tp = self.model_cfg, self.tp
        heads = c.num_kv_heads // tp.world
        return kv_cache_spec(
            c.num_layers, heads, c.head_dim, self.page_size, self.dtype, (tp.rank, tp.world)
        )

    def transfer_layout(self) -> list[CacheKind]:
        """The caches a PD transfer moves: each layer's paged K and V (whole rows: with TP this
        rank's tensors hold its shard of the KV heads)."""
        return cache_kinds(self.pool)

    @property
    def kv(self) -> KVPool:
        return self.pool

    def install_piece(self, piece: tp_install.InstallPiece) -> None:
        """A PD decode server: install a received KV piece on every rank (each keeps its heads)."""
        tp_install.install_everywhere(
            self.tp, self.device, tp_step.HEADER, self._layout(), self.page_size, piece
        )

    def gather_piece(
        self, kinds: list[CacheKind], pages: list[int], slot: int, start: int, end: int,
        prompt_len: int, resume_rows: bool,
    ) -> memoryview:  # fmt: skip
        """A PD prefill server with TP: a piece's whole rows, every rank's KV heads put together."""
        index = {k.name: i for i, k in enumerate(self._layout())}
        idx = [index[k.name] for k in kinds]
        facts = tp_install.PieceFacts(idx, list(pages), slot, start, end, prompt_len, resume_rows)
        return tp_gather.gather_whole(
            self.tp, self.device, tp_step.HEADER, self._layout(), self.page_size, facts
        )

    def _layout(self) -> list[CacheKind]:
        if self._kinds is None:
            self._kinds = self.transfer_layout()
        return self._kinds

    @torch.inference_mode()
    def forward(
        self, batch: list[ScheduledRequest], profile: StepProfiler | None = None
    ) -> torch.Tensor:
        """Logits [N, V] (float32) for the requests in `batch` that sample this step, in order;
        `profile` times the step's attention and MLP."""
        return self.forward_step(batch, profile).logits

    @torch.inference_mode()
    def forward_step(
        self, batch: list[ScheduledRequest], profile: StepProfiler | None = None
    ) -> StepLogits:
        """The sampling rows' logits, and the prompt logprobs of the requests that ask for them
        (scored from the same forward's hidden states: those rows only, eagerly)."""
        with batch_invariant.scope(self.cfg.deterministic):
            return self._step(batch, profile)

    def _step(self, batch: list[ScheduledRequest], profile: StepProfiler | None) -> StepLogits:
        fb = prepare(batch, self.page_size, self.device)
        rows = prompt_logprobs.plan(batch)
        if self.tp.is_parallel:
            if rows is not None:  # raised before the followers hear of this step
                raise NotImplementedError("prompt logprobs are not supported with tensor parallel")
            tp_step.send_batch(fb, self.tp)
        if rows is None:
            return StepLogits(self.forward_batch(fb, profile), [])
        hidden = self._hidden(fb, profile)
        logits = self.model.compute_logits(hidden[fb.sample_rows])
        idx = torch.tensor(rows.rows, dtype=torch.int64).to(self.device, non_blocking=True)
        vocab = self.model_cfg.vocab_size
        scored = prompt_logprobs.score(hidden[idx], self.model.compute_logits, vocab, rows)
        return StepLogits(logits, scored)

    @torch.inference_mode()
    def forward_batch(self, fb: ForwardBatch, profile: StepProfiler | None = None) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(fb):
            return self.graphs.run(fb, profile)
        hidden = self._hidden(fb, profile)
        return self.model.compute_logits(hidden[fb.sample_rows])

    def follow(self) -> None:
        """Ranks > 0 of tensor parallel: run each step rank 0 broadcasts until it says stop."""
        while (fb := tp_step.recv_batch(self.tp, self.device)) is not None:
            if isinstance(fb, tp_install.InstallPiece):
                tp_install.install(self._layout(), self.page_size, fb)
            elif isinstance(fb, tp_gather.GatherPiece):
                tp_gather.contribute(self.tp, self._layout(), self.page_size, fb)
            else:
                self.forward_batch(fb)

    def stop_followers(self) -> None:
        """Rank 0: end the followers' `follow` loops."""
        if self.tp.is_parallel and self.tp.rank == 0:
            tp_step.send_stop(self.tp, self.device)

    def _hidden(self, fb: ForwardBatch, profile: StepProfiler | None) -> torch.Tensor:
        """The final-normed hidden states of every row of the batch, eagerly: [T, hidden]."""
        ctx = ForwardContext(fb.attn, self.pool.layers, self.backend, self.ops, profile)
        return self.model(fb.input_ids, fb.positions, ctx)
