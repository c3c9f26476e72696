"""The engine process: a ZeroMQ loop around Engine. Bad messages fail one request, never the process."""

from __future__ import annotations

import logging
import signal
import time

import msgspec
import zmq

from kvrelay.config import EngineConfig, env
from kvrelay.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    EngineStats,
    SetStepProfile,
    Shutdown,
    StepOutputs,
    ToEngine,
)
from kvrelay.engine.pd_connector import AgentFactory
from kvrelay.engine.process_setup import die_with_parent, exit_now, setup_logging

log = logging.getLogger("kvrelay.engine")

# The loop sends something at least this often (a step's outputs, or an empty heartbeat when
# idle): an API process that hears nothing for much longer than a step knows the loop is stuck.
HEARTBEAT_S = 1.0


def _add_pd_stats(stats: EngineStats, agent) -> EngineStats:
    stats.pd_transfers = agent.state_counts()
    stats.pd_failures = dict(agent.failure_counts)
    stats.pd_bytes, stats.pd_bootstrap, stats.pd_timings = agent.take_stats()
    return stats


def engine_main(
    cfg: EngineConfig, in_addr: str, out_addr: str, make_agent: AgentFactory | None = None
) -> None:
    """`make_agent`: the PD agent factory a prefill or decode engine needs (Engine's argument;
    the server passes disagg.connector.make_agent, which this layer may not import)."""
    setup_logging()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when we stop
    die_with_parent()
    import torch

    threads = int(env("KVRELAY_CPU_THREADS"))
    if threads > 0:
        torch.set_num_threads(threads)
    zctx = zmq.Context()
    inbox = zctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = zctx.socket(zmq.PUSH)
    outbox.connect(out_addr)
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(ToEngine)
    try:
        from kvrelay.engine.engine import Engine

        if cfg.tensor_parallel_size > 1:  # rank 0: start the other ranks, then join them
            from kvrelay.engine import tp_worker
            from kvrelay.weights.loader import resolve

            tp_worker.check_supported(cfg, resolve(cfg.model, cfg.load_format, cfg.tokenizer))
            _, port = tp_worker.start_followers(cfg)
            tp_worker.init_distributed(0, cfg.tensor_parallel_size, "127.0.0.1", port, cfg.device)
        engine = Engine(cfg, make_agent=make_agent)
    except Exception as e:
        log.exception("engine failed to start")
        outbox.send(enc.encode(EngineFailed(f"{type(e).__name__}: {e}")))
        return
    r = engine.runner
    outbox.send(
        enc.encode(
            EngineReady(
                engine.max_model_len,
                engine.scheduler.page_pool.num_usable * r.page_size,
                r.page_size,
                str(r.device),
                str(r.dtype),
                role=cfg.role,
                instance_id=engine.agent.instance_id if engine.agent else "",
                transfer_addr=engine.agent.addr if engine.agent else "",
                transfer_layout=engine.agent.layout if engine.agent else "",
            )
        )
    )
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    idle_ms = 1000 if engine.agent is None else 5  # PD: transfer events arrive on other threads
    last_stats, next_idle_stats, last_sent = None, 0.0, time.monotonic()
    while True:
        engine.poll_transfers()
        timeout = 0 if engine.has_work else idle_ms
        while poller.poll(timeout):
            timeout = 0
            try:
                msg = dec.decode(inbox.recv())
            except msgspec.DecodeError:
                log.exception("undecodable message dropped")
                continue
            if isinstance(msg, AddRequest):
                engine.add(msg)
            elif isinstance(msg, AbortRequest):
                engine.abort(msg.rid)
            elif isinstance(msg, SetStepProfile):
                engine.profile_every = max(msg.every, 0)
                log.info("step profiling every=%d", engine.profile_every)
            elif isinstance(msg, Shutdown):
                log.info("engine shutting down")
                if cfg.tensor_parallel_size > 1:
                    engine.runner.stop_followers()
                if engine.agent is not None:
                    engine.agent.close()
                zctx.destroy(linger=1000)  # what is still queued goes out (bounded)
                exit_now()
        if engine.has_work:
            out = engine.step()
            if out.stats is not None and engine.agent is not None:
                _add_pd_stats(out.stats, engine.agent)
            if out.outputs or out.stats:
                outbox.send(enc.encode(out))
                last_stats, last_sent = out.stats, time.monotonic()
        elif engine.agent is not None and time.monotonic() >= next_idle_stats:
            # Transfer state also changes between steps (a reservation expires, a peer is dropped):
            # while idle, refresh the API's gauges when anything changed.
            next_idle_stats = time.monotonic() + 0.25
            stats = _add_pd_stats(engine.stats(), engine.agent)
            if stats != last_stats or stats.pd_timings:  # timings are handed over once
                outbox.send(enc.encode(StepOutputs([], stats)))
                last_stats, last_sent = stats, time.monotonic()
        if time.monotonic() - last_sent >= HEARTBEAT_S:  # idle: the API hears the loop turn
            outbox.send(enc.encode(StepOutputs([], None)))
            last_sent = time.monotonic()
