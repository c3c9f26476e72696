"""The runner contract: what a model family gives the engine's one runner (engine/runner.py).

The runner owns the device and dtype, the cache pool's size, tensor-parallel followers, prompt
logprobs and CUDA graphs; a family owns its model, its cache spec and its step. Per step:

    inputs = family.prepare(batch, all_rows, prompt_rows)   # rank 0: the scheduler's choice
    header, payload = inputs.wire()                         # rank 0 -> the other TP ranks
    inputs = family.from_wire(header, payload)              # a follower: the same step
    logits, prompt_hidden = family.forward(inputs, profile)

and a decode step that a captured graph covers runs `graphs.run(inputs)` instead. Adding a model
family touches its folder (model, cache spec, step, this contract) and one registry entry.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvrelay.cache.spec import CachePool, CacheSpec

WIRE_FIELDS = 6  # ints of a step's header on the TP channel (after its kind)

# Batch-size buckets of every family's decode CUDA graphs (a batch runs in the next one up).
BUCKETS = (
    1,
    2,
    4,
    8,
    12,
    16,
    24,
    32,
    40,
    48,
    56,
    64,
    80,
    96,
    112,
    128,
    160,
    192,
    224,
    256,
    320,
    384,
    448,
    512,
)


class Request(Protocol):
    """What a step reads of a scheduled request (engine/request.py)."""

    num_computed: int
    matched_tokens: int
    pages: list[int]
    state_slot: int

    def token_slice(self, start: int, end: int) -> list[int]: ...


class Scheduled(Protocol):
    """One request of the scheduler's choice (engine/scheduler.py ScheduledRequest)."""

    req: Request
    num_new_tokens: int
    samples: bool


class StepInputs(Protocol):
    """One forward step's inputs, as the family's forward reads them."""

    def wire(self) -> tuple[list[int], torch.Tensor]:
        """(at most WIRE_FIELDS ints, an int64 payload on the device): what a TP follower needs
        to rebuild this step (`from_wire`)."""
        ...


class GraphRunner(Protocol):
    """Decode CUDA graphs of one family, captured over its static buffers."""

    def can_run(self, inputs: StepInputs, profile) -> bool: ...

    def run(self, inputs: StepInputs, profile) -> torch.Tensor:
        """Float32 logits of the step's sampled rows."""
        ...


class Runnable(Protocol):
    """A model family's side of the runner contract, built once per rank with its weights:
    `(EngineConfig, model config, model, device, dtype, TPGroup)` (the registry names the class
    and, in `rank_model`, how each rank's model is loaded)."""

    model: torch.nn.Module
    page_size: int  # the page size the family's caches use (it may round the requested one)
    num_state_slots: int  # per-request state slots (0: the family keeps none)

    @staticmethod
    def check(cfg, model_cfg, device: torch.device) -> None:
        """Refuse what the family cannot run (raise ValueError), before any weight is read."""
        ...

    def cache_spec(self) -> CacheSpec: ...

    def reserve_bytes(self) -> int:
        """Device memory to leave free beside the caches (a full step's activations)."""
        ...

    def build_pool(self, num_pages: int) -> CachePool: ...

    def prepare_kernels(self) -> None:
        """Set up what the forward runs with once the pool is sized (DeepSeek-V4: FP8 linears,
        fused norms and projections, whose memory the pool's sizing did not count before)."""
        ...

    def describe(self) -> str:
        """The family's facts for the runner's ready line."""
        ...

    def prepare(self, batch: list[Scheduled], all_rows: bool, prompt_rows: list[int]) -> StepInputs:
        """The step of `batch`: each sampling request's last row is sampled (every row if
        `all_rows`); `prompt_rows` (rows of the step's tokens) are scored for prompt logprobs."""
        ...

    def from_wire(self, header: list[int], payload: torch.Tensor) -> StepInputs: ...

    def forward(self, inputs: StepInputs, profile) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits of the sampled rows, final hidden states of the prompt rows or None)."""
        ...

    def make_graphs(self, max_batch: int, max_model_len: int) -> GraphRunner | None:
        """The family's decode graphs (called on CUDA with graphs enabled), or None."""
        ...

    def before_step(self, batch: list[Scheduled]) -> None:
        """Anything a request's state needs before this step reads it (rank 0 only)."""
        ...

    # Speculative decoding (engine/drafter.py), as a class attribute: "overwrite" (whatever a
    # rejected draft wrote into a request's state lies where nothing reads it before its
    # position is computed again) or "" (no speculation).
    speculation: str

    def warm_up(self, graphs: GraphRunner | None) -> None:
        """Compile before the engine reports ready (a no-op where nothing compiles)."""
        ...
