"""The one runner: owns the device and dtype, the cache pool's size, tensor-parallel followers,
prompt logprobs and CUDA graphs for every model family; the family (models/base.py, named by
its registry entry) owns its model, cache spec and step.

Which pages are in use is the scheduler's business: the runner only says how many its tensors hold.
"""

from __future__ import annotations

import logging
import os

import torch

from kvrelay.cache.paging import pages_for
from kvrelay.cache.spec import CacheKind, CacheSpec, cache_kinds
from kvrelay.config import EngineConfig
from kvrelay.engine import drafter, prompt_logprobs, tp_gather, tp_install, tp_step
from kvrelay.engine.prompt_logprobs import PromptRows, StepLogits
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.layers import batch_invariant
from kvrelay.layers.parallel import TPGroup
from kvrelay.layers.step_profile import StepProfiler
from kvrelay.models import registry
from kvrelay.models.base import Runnable
from kvrelay.weights.loader import ModelSource

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


def make_runner(cfg: EngineConfig, src: ModelSource) -> ModelRunner:
    return ModelRunner(cfg, src)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, src: ModelSource) -> None:
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        fam = registry.family(src.config.architecture)
        family_cls = fam.load("runnable")
        drafter.check_supported(cfg.speculative, fam.name, family_cls)  # before any weight is read
        family_cls.check(cfg, src.config, self.device)
        batch_invariant.check_supported(cfg, self.device, fam.name)  # refuses what is not invariant
        # Tensor parallel: torch.distributed is already initialised by whoever started the rank.
        self.tp = TPGroup.from_default(cfg.tensor_parallel_size)
        self.model_cfg = src.config
        torch.manual_seed(cfg.seed)
        self.model = fam.load("rank_model")(cfg, src, self.dtype, self.device, self.tp)
        self.family: Runnable = family_cls(
            cfg, src.config, self.model, self.device, self.dtype, self.tp
        )
        self.page_size = self.family.page_size
        self.num_state_slots = self.family.num_state_slots  # the scheduler hands them out
        num_pages = self.tp.min_int(
            self._num_pages(self.family.cache_spec())
        )  # same ids on every rank
        self.pool = self.family.build_pool(num_pages)
        self.num_pages = num_pages  # page 0 included (the dummy page padded rows write to)
        pool_tokens = (num_pages - 1) * self.page_size
        self.max_model_len = min(
            cfg.max_model_len or self.model_cfg.max_position_embeddings, pool_tokens
        )
        self.family.prepare_kernels()
        self._kinds: list[CacheKind] | None = None  # transfer_layout(), for PD decode installs
        self.graphs = None
        with batch_invariant.scope(cfg.deterministic):  # graphs capture the invariant ops
            if self.device.type == "cuda" and cfg.cuda_graphs:
                self.graphs = self.family.make_graphs(cfg.max_cuda_graph_batch, self.max_model_len)
            self.family.warm_up(self.graphs)
        log.info(
            "runner ready %s device=%s dtype=%s pages=%d page_size=%d max_model_len=%d "
            "tp_rank=%d/%d cuda_graphs=%s",
            self.family.describe(), self.device, self.dtype, num_pages, self.page_size,
            self.max_model_len, self.tp.rank, self.tp.world, self.graphs is not None,
        )  # fmt: skip

    def _num_pages(self, spec: CacheSpec) -> int:
        if self.cfg.cache.max_total_tokens:
            return pages_for(self.cfg.cache.max_total_tokens, self.page_size) + 1
        slots = self.num_state_slots * spec.bytes_per_slot
        budget = cache_budget(self.cfg, self.device, self.family.reserve_bytes()) - slots
        return max(int(budget // spec.bytes_per_page), 2)

    # -- the caches, for PD ----------------------------------------------------------------
    def transfer_layout(self) -> list[CacheKind]:
        """Every tensor of the pool as its cache spec declares it for a PD transfer (whole rows:
        with dense TP this rank's tensors hold its shard of the KV heads)."""
        return cache_kinds(self.pool)

    def _layout(self) -> list[CacheKind]:
        if self._kinds is None:
            self._kinds = self.transfer_layout()
        return self._kinds

    def install_piece(self, piece: tp_install.InstallPiece) -> None:
        """A PD decode server: install a received KV piece on every rank (each keeps its part)."""
        tp_install.install_everywhere(
            self.tp, self.device, tp_step.HEADER, self._layout(), self.page_size, piece
        )

    def gather_piece(
        self, kinds: list[CacheKind], pages: list[int], slot: int, start: int, end: int,
        prompt_len: int, resume_rows: bool,
    ) -> memoryview:  # fmt: skip
        """A PD prefill server with dense TP: a piece's whole rows, every rank's KV heads put
        together."""
        index = {k.name: i for i, k in enumerate(self._layout())}
        idx = [index[k.name] for k in kinds]
        facts = tp_install.PieceFacts(idx, list(pages), slot, start, end, prompt_len, resume_rows)
        return tp_gather.gather_whole(
            self.tp, self.device, tp_step.HEADER, self._layout(), self.page_size, facts
        )

    @property
    def kv(self):
        """The pool (dense models' old name)."""
        return self.pool

    @property
    def cache(self):
        """The pool (DeepSeek-V4's old name)."""
        return self.pool

    # -- steps -----------------------------------------------------------------------------
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
        family = self.family
        family.before_step(batch)
        inputs = family.prepare(batch, all_rows, rows.rows if rows is not None else [])
        if self.tp.is_parallel:
            if rows is not None:  # raised before the followers hear of this step
                raise NotImplementedError("prompt logprobs are not supported with tensor parallel")
            tp_step.send_step(inputs, self.tp, self.device)
        if rows is None:
            return StepLogits(self.forward_inputs(inputs, profile), [])
        with batch_invariant.scope(self.cfg.deterministic):
            logits, hidden = family.forward(inputs, profile)
            vocab = self.model_cfg.vocab_size
            head = self.model.compute_logits
            return StepLogits(logits, prompt_logprobs.score(hidden, head, vocab, rows))

    @torch.inference_mode()
    def propose_drafts(self, batch, follow: dict[str, tuple[int, int]], wants: set[str]) -> None:
        """A family that drafts from the model itself (mtp) does so once the step's tokens are
        committed (models/deepseek_v4/runnable.py propose_drafts)."""
        propose = getattr(self.family, "propose_drafts", None)
        if propose is not None:
            propose(batch, follow, wants)

    @torch.inference_mode()
    def forward_inputs(self, inputs, profile: StepProfiler | None = None) -> torch.Tensor:
        """The sampled rows' logits of a prepared step: replayed from a graph when one covers
        it, else eagerly (benchmarks time this alone). `--deterministic`'s dispatch mode wraps
        eager forwards only: a replay runs the kernels captured inside it (around the whole step,
        the mode's Python call per op of the step's other work came to ~0.65 ms at batch 1 on
        an H100: step minus forward 0.85 ms against 0.20 without the mode)."""
        if self.graphs is not None and self.graphs.can_run(inputs, profile):
            return self.graphs.run(inputs, profile)
        with batch_invariant.scope(self.cfg.deterministic):
            return self.family.forward(inputs, profile)[0]

    # -- tensor parallel -------------------------------------------------------------------
    def follow(self) -> None:
        """Ranks > 0 of tensor parallel: run each step rank 0 broadcasts until it says stop."""
        with torch.inference_mode():
            while (msg := tp_step.recv(self.tp, self.device, self.family)) is not None:
                if isinstance(msg, tp_install.InstallPiece):
                    tp_install.install(self._layout(), self.page_size, msg)
                elif isinstance(msg, tp_gather.GatherPiece):
                    tp_gather.contribute(self.tp, self._layout(), self.page_size, msg)
                else:
                    self.family.forward(msg, None)

    def stop_followers(self) -> None:
        """Rank 0: end the followers' `follow` loops."""
        if self.tp.is_parallel and self.tp.rank == 0:
            tp_step.send_stop(self.tp, self.device)
