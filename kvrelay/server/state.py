"""What every route of one server reads: its config, model source and name, engine client,
tokenizer and chat format (set once the engine is up), metrics and step telemetry. One object,
made by `create_app` and handed to each route module's `register(app, state)`."""

from __future__ import annotations

import time
from dataclasses import asdict

from kvrelay import provenance
from kvrelay.config import ServerConfig, env_snapshot, redacted
from kvrelay.server.chat_format import ChatFormat
from kvrelay.server.engine_client import EngineClient
from kvrelay.server.generation_defaults import model_defaults
from kvrelay.server.metrics import Metrics
from kvrelay.server.telemetry import StepTelemetry
from kvrelay.weights.source import resolve


class ServerState:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.src = resolve(cfg.engine.model, cfg.engine.load_format, cfg.engine.tokenizer)
        self.model_name = cfg.served_model_name or self.src.name
        self.metrics = Metrics()
        self.client = EngineClient(cfg.engine)
        self.telemetry = StepTelemetry()
        self.telemetry.profile_every = cfg.engine.step_profile_every
        self.client.on_step = self._on_step
        self.tokenizer = None
        self.chat_format: ChatFormat | None = None
        self.sampling_defaults = model_defaults(cfg.generation_config, self.src)
        self._info: dict | None = None
        self.started = int(time.time())

    def _on_step(self, msg) -> None:
        self.metrics.on_step(msg)
        self.telemetry.on_step(msg)

    def count_error(self, status: int) -> None:
        self.metrics.errors.labels(status=str(status)).inc()

    @property
    def pd_secret(self) -> str:
        """The secret PD fields must be signed with ("": this server takes none)."""
        return self.cfg.engine.disagg.pd_secret

    def info(self) -> dict:
        """Configuration and provenance; computed once (none of it changes while serving)."""
        if self._info is None:
            r = self.client.ready
            self._info = {
                "model": self.model_name,
                "config": redacted(asdict(self.cfg)),
                "engine": {
                    "max_model_len": r.max_model_len,
                    "max_total_tokens": r.max_total_tokens,
                    "page_size": r.page_size,
                    "device": r.device,
                    "dtype": r.dtype,
                    "role": r.role,
                },
                "gpu": provenance.device_name(r.device),
                "versions": provenance.versions(),
                "git": provenance.git_commit(),
                "env": env_snapshot(),
            }
        return self._info

    @property
    def max_model_len(self) -> int:
        return self.client.ready.max_model_len
