"""The engine's implementation of the PD connector's two sides (pd_connector.py): the scheduler
side over the scheduler's public operations, the worker side over the runner's caches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvrelay.cache.spec import CacheKind
from kvrelay.engine.kv_pieces import gather, piece_rows
from kvrelay.engine.messages import RequestOutput
from kvrelay.engine.pd_connector import SchedulerSide, WorkerSide
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import Fence
from kvrelay.engine.tp_install import InstallPiece

if TYPE_CHECKING:
    from kvrelay.engine.engine import Engine


class EngineSchedulerSide(SchedulerSide):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler

    @property
    def caches_prompts(self) -> bool:
        return self.scheduler.prefix is not None

    def reserve(self, req: Request) -> None:
        self.scheduler.reserve_transfer(req)

    def admit(self, req: Request) -> None:
        self.scheduler.add(req)

    def admit_transferred(self, req: Request, first: RequestOutput) -> None:
        eng = self.engine
        tok = first.token_ids[0]
        req.output_ids.append(tok)
        if req.params.temperature > 0 and req.generator is not None:
            # Prefill drew the first token from this seed: make the same one draw (one exponential per
            # vocabulary entry, as the sampler does) so seeded sampling continues exactly as in one server.
            torch.empty(
                eng.src.config.vocab_size, dtype=torch.float32, device=eng.runner.device
            ).exponential_(generator=req.generator)
        reason = eng.stop_reason(req, tok)
        first.finish_reason = reason
        eng.emit(first)
        if reason is not None:
            self.scheduler.finish(req, reason)
        else:
            self.scheduler.admit_transferred(req)

    def finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)

    def finish_fenced(self, req: Request, reason: str) -> Fence:
        return self.scheduler.finish_fenced(req, reason)

    def release(self, fence: Fence) -> None:
        self.scheduler.lift(fence)

    def emit(self, out: RequestOutput) -> None:
        self.engine.emit(out)


class RunnerWorkerSide(WorkerSide):
    def __init__(self, engine: Engine) -> None:
        self.runner = r = engine.runner
        self.kinds = r.transfer_layout()
        self.page_size, self.device = r.page_size, r.device
        self.vocab_size = engine.src.config.vocab_size
        self.max_model_len = engine.max_model_len
        self._index = {k.name: i for i, k in enumerate(self.kinds)}  # as the runner lists them

    def gather_rows(
        self, kinds: list[CacheKind], pages: list[int], slot: int, start: int, end: int,
        prompt_len: int, resume_rows: bool,
    ) -> memoryview:  # fmt: skip
        if kinds[0].shard[1] > 1:  # dense TP: each rank holds its KV heads (tp_gather.py)
            args = (kinds, pages, slot, start, end, prompt_len, resume_rows)
            return self.runner.gather_piece(*args)
        rows = piece_rows(kinds, pages, slot, self.page_size, start, end, prompt_len, resume_rows)
        return gather(kinds, rows)

    def install_rows(
        self, kinds: list[CacheKind], pages: list[int], slot: int, start: int, end: int,
        prompt_len: int, resume_rows: bool, payload,
    ) -> None:  # fmt: skip
        idx = [self._index[k.name] for k in kinds]
        facts = (idx, list(pages), slot, start, end, prompt_len, resume_rows)
        self.runner.install_piece(InstallPiece(*facts, payload))  # with TP: every rank
