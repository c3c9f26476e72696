"""A prefill engine and a decode engine in one process, talking over real TCP, pumped by hand."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvrelay.config import CacheConfig, DisaggConfig, EngineConfig, SchedulerConfig
from kvrelay.disagg.connector import make_agent
from kvrelay.engine.engine import Engine
from kvrelay.engine.messages import AddRequest, PDParams, SamplingParams
from kvrelay.weights.loader import resolve

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
PD_SECRET = "engine-pair-test-secret"  # what both engines of a pair share


def dense_engine(
    role: str, max_total_tokens: int = 4096, prefix_cache: bool = True, **disagg
) -> Engine:
    """A tiny dense engine (qwen3-tiny, dummy weights); prompts over 32 tokens are chunked."""
    return Engine(
        EngineConfig(
            model="qwen3-tiny",
            load_format="dummy",
            role=role,
            cache=CacheConfig(
                max_total_tokens=max_total_tokens, page_size=16, prefix_cache=prefix_cache
            ),
            scheduler=SchedulerConfig(max_num_batched_tokens=32),
            disagg=DisaggConfig(**{"layers_per_chunk": 1, "pd_secret": PD_SECRET, **disagg}),
        ),
        make_agent=make_agent,
    )


def dsv4_engine(
    role: str,
    budget: int = 22,
    max_running: int = 16,
    index_k: str = "auto",
    prefix_cache: bool = True,
    max_total_tokens: int = 4096,
    kv_reserve_ratio: float = 1.0,
    **disagg,
) -> Engine:
    """A tiny DeepSeek-V4 engine (dsv4-tiny, dummy weights, CPU float32; pages of 16 tokens, a
    16-token window). QAT simulation off: its roundings turn last-bit differences between batch
    shapes into visible ones (see tests/engine/test_dsv4_engine.py)."""
    src = resolve("dsv4-tiny", "dummy")
    src = dataclasses.replace(src, config=src.config.with_(qat_simulation=False))
    cfg = EngineConfig(
        model="dsv4-tiny",
        load_format="dummy",
        device="cpu",
        dtype="float32",
        role=role,
        cache=CacheConfig(
            max_total_tokens=max_total_tokens, index_k_dtype=index_k, prefix_cache=prefix_cache
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget,
            max_running_requests=max_running,
            kv_reserve_ratio=kv_reserve_ratio,
        ),
        disagg=DisaggConfig(**{"layers_per_chunk": 2, "pd_secret": PD_SECRET, **disagg}),
    )
    return Engine(cfg, src, make_agent)


class Pair:
    def __init__(self, prefill: Engine, decode: Engine) -> None:
        self.p, self.d = prefill, decode
        self.outs: dict[tuple[str, str], list] = {}

    def submit(
        self,
        rid: str,
        ids: list[int],
        params=PARAMS,
        tid: str | None = None,
        d_ids=None,
        send_prefill: bool = True,
        send_decode: bool = True,
    ) -> None:
        tid = tid or f"t-{rid}"
        if send_decode:
            self.d.add(AddRequest(rid, d_ids or ids, params, PDParams("decode", tid)))
        if send_prefill:
            pd = PDParams("prefill", tid, self.d.agent.addr, self.d.agent.instance_id)
            self.p.add(AddRequest(rid, ids, params, pd))

    def pump(self, done, timeout: float = 20.0) -> None:
        deadline = time.time() + timeout
        while not done():
            assert time.time() < deadline, f"no progress: {self.outs}"
            for side, e in (("prefill", self.p), ("decode", self.d)):
                e.poll_transfers()
                if e.has_work:
                    for o in e.step().outputs:
                        self.outs.setdefault((side, o.rid), []).append(o)
            time.sleep(0.001)

    def finished(self, side: str, rid: str) -> bool:
        return any(o.finish_reason for o in self.outs.get((side, rid), []))

    def last(self, side: str, rid: str):
        return self.outs[(side, rid)][-1]

    def assert_clean(self) -> None:
        self.pump(
            lambda: (
                not self.p.transfers_in_flight
                and not self.d.transfers_in_flight
                and not self.p.has_work
                and not self.d.has_work
            )
        )
        for e in (self.p, self.d):
            e.check_idle_integrity()
            e.flush_prefix_cache()  # what the prefix cache alone holds
            assert e.scheduler.page_pool.num_used == 0


@contextmanager
def pairs() -> Iterator[Callable[[Engine, Engine], Pair]]:
    """Builds pairs; closes their transfer agents (sockets, heartbeat threads) after."""
    made: list[Pair] = []

    def make(prefill: Engine, decode: Engine) -> Pair:
        made.append(Pair(prefill, decode))
        return made[-1]

    try:
        yield make
    finally:
        for pr in made:
            pr.p.agent.close()
            pr.d.agent.close()
