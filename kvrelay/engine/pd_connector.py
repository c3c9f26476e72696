"""The PD connector: what a transfer agent (disagg/: prefill's sender, decode's receiver) may ask
of the engine, in two small interfaces, and what the engine asks of the agent.

- `SchedulerSide`: requests and their pages (reserve, admit, finish, fence and release), and
  the outputs the engine sends on. Only the scheduler's public operations stand behind it.
- `WorkerSide`: the KV caches as named cache kinds, and a piece's rows out of them (gather) or
  into them (install), on every tensor-parallel rank.
- `PDAgent`: the engine's view of an agent (add, reject, abort, on_sampled, poll, stats).

The agent gets these two sides, never the `Engine`. disagg/ sits above the engine (pyproject's
layer contract), so the engine does not import it: a PD-role engine is given the factory that
builds its agent (`AgentFactory`; disagg.connector.make_agent, which the server's engine process
entry point, server/engine_client.py, and the in-process tests pass in). Anchors: vLLM `kv_connector/v1/base.py` (scheduler side / worker side), SGLang
`disaggregation/base/conn.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kvrelay.cache.spec import CacheKind
    from kvrelay.config import EngineConfig
    from kvrelay.engine.messages import PDParams, RequestOutput
    from kvrelay.engine.request import Request
    from kvrelay.engine.scheduler import Fence


class SchedulerSide(ABC):
    """The engine thread's request and page operations a transfer agent may use."""

    @property
    @abstractmethod
    def caches_prompts(self) -> bool:
        """Decode: a prefix cache takes the prompt's pages (prefill must send the rows a later
        hit at the prompt's last full page reads)."""

    @abstractmethod
    def reserve(self, req: Request) -> None:
        """Decode: hold pages (and a state slot) for a transfer, sharing a cached prefix
        (req.matched_tokens); raises cache.block_pool.OutOfPages when it does not fit."""

    @abstractmethod
    def admit(self, req: Request) -> None:
        """Prefill: compute the prompt here (decode holds pages for its KV)."""

    @abstractmethod
    def admit_transferred(self, req: Request, first: RequestOutput) -> None:
        """Decode: the prompt's KV is installed (req.num_computed, resume_from set) and `first`
        holds prefill's first token: emit it and continue the request here as if this engine had
        computed the prompt (decoding, or finished when the first token ends it)."""

    @abstractmethod
    def finish(self, req: Request, reason: str) -> None:
        """The request ends here; its pages and slot go back."""

    @abstractmethod
    def finish_fenced(self, req: Request, reason: str) -> Fence:
        """Decode: the request ends, but its pages and slot stay out of the pool (a peer may
        still write into them) until `release`."""

    @abstractmethod
    def release(self, fence: Fence) -> None:
        """Return a fenced request's pages and slot to the pool."""

    @abstractmethod
    def emit(self, out: RequestOutput) -> None:
        """Queue an output for the next step's outputs."""


class WorkerSide(ABC):
    """The KV caches, as a transfer sees them: named cache kinds and a piece's rows."""

    kinds: list[CacheKind]  # the runner's transfer_layout(), in its order
    page_size: int
    vocab_size: int
    max_model_len: int
    device: torch.device

    @abstractmethod
    def gather_rows(
        self, kinds: list[CacheKind], pages: list[int], slot: int, start: int, end: int,
        prompt_len: int, resume_rows: bool,
    ) -> memoryview:  # fmt: skip
        """Prefill: the whole rows (every tensor-parallel rank's part) of the piece tokens
        [start, end) of a `prompt_len`-token prompt filled, as host bytes (kv_pieces.piece_rows
        says which)."""

    @abstractmethod
    def install_rows(
        self, kinds: list[CacheKind], pages: list[int], slot: int, start: int, end: int,
        prompt_len: int, resume_rows: bool, payload,
    ) -> None:  # fmt: skip
        """Decode: install a verified payload (whole rows, as `gather_rows` gives them) into the
        pools of every tensor-parallel rank (each keeps its part)."""


class PDAgent(Protocol):
    """A transfer agent, as the engine and its process use it (engine thread only)."""

    role: str  # "prefill" | "decode"
    instance_id: str
    addr: str  # decode: where prefills connect ("" on prefill)
    layout: str  # the cache layout fingerprint peers must share
    failure_counts: dict[str, int]

    def add(self, req: Request, pd: PDParams) -> None: ...

    def reject(self, transfer_id: str, reason: str) -> None: ...

    def abort(self, rid: str) -> bool: ...

    def on_sampled(self, req: Request, out: RequestOutput) -> bool:
        """Prefill: after the prompt's last chunk; True when the request was the agent's."""
        ...

    def poll(self) -> None: ...

    @property
    def in_flight(self) -> bool: ...

    def state_counts(self) -> dict[str, int]: ...

    def take_stats(self) -> tuple[dict[str, dict[str, int]], dict[str, int], list]: ...

    def close(self) -> None: ...


AgentFactory = Callable[["EngineConfig", SchedulerSide, WorkerSide], PDAgent]
