"""Builds a PD role's transfer agent from the connector's two sides (engine/pd_connector.py's
`AgentFactory`; the server's engine process and the in-process tests hand `make_agent` to
Engine): prefill's sender or decode's receiver, with the test faults the config asks for
installed (faults.py; none unless a test flag is set)."""

from __future__ import annotations

from kvrelay.config import EngineConfig
from kvrelay.disagg.faults import send_faults
from kvrelay.disagg.receiver import DecodeReceiver
from kvrelay.disagg.sender import PrefillSender
from kvrelay.engine.pd_connector import PDAgent, SchedulerSide, WorkerSide


def make_agent(cfg: EngineConfig, scheduler: SchedulerSide, worker: WorkerSide) -> PDAgent:
    if cfg.role == "prefill":
        return PrefillSender(cfg.disagg, scheduler, worker, send_faults(cfg))
    if cfg.role == "decode":
        return DecodeReceiver(cfg.disagg, scheduler, worker)
    raise ValueError(f"role {cfg.role!r} has no transfer agent (prefill and decode do)")
