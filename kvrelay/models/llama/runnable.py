"""The dense (Llama-family) side of the runner contract (models/base.py): the attention backend
and fused ops, each layer's paged K/V, the step, and the decode graphs."""

from __future__ import annotations

import torch

from kvrelay.cache.kv_pool import KVPool, kv_cache_spec
from kvrelay.cache.paging import pages_for
from kvrelay.cache.spec import CacheSpec
from kvrelay.config import EngineConfig, ModelConfig
from kvrelay.layers.attention import InvariantTritonAttention, make_backend
from kvrelay.layers.batch_invariant_attention import BatchInvariantAttention
from kvrelay.layers.ops import TORCH_OPS, triton_ops
from kvrelay.layers.parallel import TPGroup
from kvrelay.layers.step_profile import StepProfiler
from kvrelay.models.base import Scheduled
from kvrelay.models.llama.model import ForwardContext
from kvrelay.models.llama.step import ForwardBatch, from_wire, prepare


class DenseRunnable:
    # Speculative decoding (engine/drafter.py): a request's state is its KV pages, so a rejected
    # draft's rows are simply overwritten when their positions are computed again.
    speculation = "overwrite"

    def __init__(
        self, cfg: EngineConfig, model_cfg: ModelConfig, model, device: torch.device,
        dtype: torch.dtype, tp: TPGroup,
    ) -> None:  # fmt: skip
        self.cfg, self.model_cfg, self.model = cfg, model_cfg, model
        self.device, self.dtype, self.tp = device, dtype, tp
        self.page_size = cfg.cache.page_size
        self.num_state_slots = 0  # no per-request state outside the KV pages
        backend = cfg.attention_backend
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
        elif backend == "reference":  # DeepSeek-V4's oracle path; dense: the torch reference
            backend = "torch"
        self.backend_name = backend
        self.backend = make_backend(backend)
        if cfg.deterministic:  # batch-invariant: the GPU's Triton kernel, the CPU's torch schedule
            cuda = device.type == "cuda"
            self.backend = InvariantTritonAttention() if cuda else BatchInvariantAttention()
        # The Triton backend also brings the fused per-token kernels; "torch" is the reference.
        self.ops = triton_ops() if backend == "triton" else TORCH_OPS
        self.pool: KVPool | None = None

    @staticmethod
    def check(cfg: EngineConfig, model_cfg: ModelConfig, device: torch.device) -> None:
        """Refuse what only other families take, before any weight is read."""
        if cfg.linear_weights != "auto":
            raise ValueError(
                f"--linear-weights {cfg.linear_weights} is for DeepSeek-V4 models; "
                f"{model_cfg.architecture} runs its weights in the model dtype"
            )
        if cfg.expert_parallel or cfg.ep_dispatch != "all-reduce":
            raise ValueError("--expert-parallel and --ep-dispatch are for DeepSeek-V4 (MoE) models")

    def cache_spec(self) -> CacheSpec:
        """Each layer's paged K and V: with TP, this rank's shard of the KV heads."""
        c, tp = self.model_cfg, self.tp
        heads = c.num_kv_heads // tp.world
        return kv_cache_spec(
            c.num_layers, heads, c.head_dim, self.page_size, self.dtype, (tp.rank, tp.world)
        )

    def reserve_bytes(self) -> int:
        """Activations of a full prefill step, and the graphs' logits (each bucket's decode
        graph, and its verify graph of 1 + K rows per request when speculating)."""
        c, cfg = self.model_cfg, self.cfg
        act = cfg.scheduler.max_num_batched_tokens * (c.hidden_size * 16 + c.vocab_size * 4)
        q = cfg.speculative.rows_per_request
        rows = 1 if q == 1 else 1 + q
        return act + 2 * cfg.max_cuda_graph_batch * rows * c.vocab_size * 4

    def build_pool(self, num_pages: int) -> KVPool:
        self.pool = KVPool(self.cache_spec(), num_pages, self.device)
        return self.pool

    def prepare_kernels(self) -> None:
        """Nothing to set up once the pool is sized (the backend was chosen at start)."""

    def prepare(
        self, batch: list[Scheduled], all_rows: bool, prompt_rows: list[int]
    ) -> ForwardBatch:
        if all_rows:
            raise NotImplementedError("dense steps return the sampled rows' logits only")
        return prepare(batch, self.page_size, self.device, prompt_rows)

    def from_wire(self, header: list[int], payload: torch.Tensor) -> ForwardBatch:
        return from_wire(header, payload)

    def forward(
        self, fb: ForwardBatch, profile: StepProfiler | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Eagerly: the sampled rows' logits, the prompt rows' final-normed hidden states."""
        ctx = ForwardContext(fb.attn, self.pool.layers, self.backend, self.ops, profile)
        hidden = self.model(fb.input_ids, fb.positions, ctx)
        logits = self.model.compute_logits(hidden[fb.sample_rows])
        return logits, None if fb.prompt_rows is None else hidden[fb.prompt_rows]

    def make_graphs(self, max_batch: int, max_model_len: int):
        """Decode graphs per batch bucket, and verify graphs of 1 + K rows per request when
        speculating, captured now (single rank only)."""
        if self.tp.is_parallel:
            return None
        from kvrelay.models.llama.graphs import CudaGraphRunner

        return CudaGraphRunner(
            self.model,
            self.pool.layers,
            self.backend,
            self.ops,
            max_batch,
            pages_for(max_model_len, self.page_size),
            self.device,
            profiled=self.cfg.step_profile_every > 0,
            max_q=self.cfg.speculative.rows_per_request,
            page_size=self.page_size,
        )

    def before_step(self, batch: list[Scheduled]) -> None:
        """A dense request's state is its KV pages: nothing to restore."""

    def warm_up(self, graphs) -> None:
        """The graphs' capture compiled what decode runs; prefill compiles nothing lazily."""

    def describe(self) -> str:
        return f"backend={self.backend_name}"
