"""The children of a `kvrelay up` stack: its configuration, and each child's argv, environment
(GPUs, secrets), URL and log file: N prefill and M decode servers, then the router over them all.
How replicas share GPUs and ports is kvrelay/ops/replicas.py."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.config import env
from kvrelay.ops.replicas import (
    check_distinct,
    gpu_groups,
    pick_free,
    replica_name,
    replica_ports,
)


@dataclass(frozen=True)
class LaunchConfig:
    host: str = "127.0.0.1"  # where the router listens
    port: int = 8000  # router port (0: any free port)
    server_host: str = "127.0.0.1"  # where prefill/decode listen
    prefill_port: int = 0  # base port: replica i listens on it + i (0: any free ports)
    decode_port: int = 0
    transfer_port: int = 0  # decode's KV listener (base port, as above)
    prefill_replicas: int = 1
    decode_replicas: int = 1
    log_dir: str = "kvrelay-logs"
    prefill_gpus: str | None = None  # split among the replicas: kvrelay/ops/replicas.py
    decode_gpus: str | None = None
    server_args: tuple[str, ...] = ()  # engine args for every server
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    health_timeout_s: float = 600.0
    stop_timeout_s: float = 20.0
    max_backoff_s: float = 30.0
    unhealthy_s: float = field(default_factory=lambda: float(env("KVRELAY_UP_UNHEALTHY_S")))
    unresponsive_s: float = field(default_factory=lambda: float(env("KVRELAY_UP_UNRESPONSIVE_S")))
    max_restarts: int = field(default_factory=lambda: int(env("KVRELAY_UP_MAX_RESTARTS")))
    restart_window_s: float = field(
        default_factory=lambda: float(env("KVRELAY_UP_RESTART_WINDOW_S"))
    )
    restart_scope: str = field(default_factory=lambda: env("KVRELAY_UP_RESTART_SCOPE"))
    api_key: str = field(default="", repr=False)  # "": none
    pd_secret: str = field(default="", repr=False)  # shared by the router and every server


@dataclass
class ChildSpec:
    name: str  # prefill, decode, router; prefill-0, prefill-1, ... with several replicas
    argv: list[str]
    env: dict[str, str]
    url: str
    log_path: Path
    role: str = ""  # prefill, decode or router ("": its name)

    def __post_init__(self) -> None:
        self.role = self.role or self.name


@dataclass(frozen=True)
class _Server:
    role: str
    name: str
    port: int
    transfer_port: int  # decode only (0 for prefill)
    gpus: str | None


def _servers(cfg: LaunchConfig) -> list[_Server]:
    """Every server of the stack with its explicit ports (0: to be picked); raises ValueError on
    GPUs that do not split among the replicas or on two children given one port."""
    out: list[_Server] = []
    for role, n, base, gpus in (
        ("prefill", cfg.prefill_replicas, cfg.prefill_port, cfg.prefill_gpus),
        ("decode", cfg.decode_replicas, cfg.decode_port, cfg.decode_gpus),
    ):
        groups = gpu_groups(gpus, n, role)
        tports = replica_ports(cfg.transfer_port, n) if role == "decode" else [0] * n
        for i, (port, g) in enumerate(zip(replica_ports(base, n), groups, strict=True)):
            out.append(_Server(role, replica_name(role, i, n), port, tports[i], g))
    check_distinct(
        [("router", cfg.port)]
        + [(s.name, s.port) for s in out]
        + [(f"{s.name} (transfer)", s.transfer_port) for s in out]
    )
    return out


def validate(cfg: LaunchConfig) -> None:
    """Raises ValueError, with the reason, for a stack that cannot be laid out."""
    _servers(cfg)


def build_specs(cfg: LaunchConfig) -> list[ChildSpec]:
    """The servers (prefill replicas, then decode), then the router: argv, env, URL and log of
    each. Ports left 0 are picked free now and kept for the stack's life (restarts reuse them)."""
    servers = _servers(cfg)
    taken = {cfg.port} | {s.port for s in servers} | {s.transfer_port for s in servers}

    def port(p: int, host: str) -> int:
        return p or pick_free(host, taken)

    rport = port(cfg.port, cfg.host)
    logs = Path(cfg.log_dir)
    py = [sys.executable, "-m", "kvrelay.cli"]
    base_env = dict(os.environ, KVRELAY_PD_SECRET=cfg.pd_secret)
    if cfg.api_key:
        base_env["KVRELAY_API_KEY"] = cfg.api_key

    specs: list[ChildSpec] = []
    for s in servers:
        child_env = dict(base_env)
        if s.gpus is not None:
            child_env["CUDA_VISIBLE_DEVICES"] = s.gpus
        p = port(s.port, cfg.server_host)
        argv = [*py, "serve", "--role", s.role, "--host", cfg.server_host, "--port", str(p)]
        if s.role == "decode":
            tport = port(s.transfer_port, cfg.server_host)
            argv += ["--transfer-host", cfg.server_host, "--transfer-port", str(tport)]
        extra = cfg.prefill_args if s.role == "prefill" else cfg.decode_args
        argv += [*cfg.server_args, *extra]
        ranks = len(s.gpus.split(",")) if s.gpus else 1
        if ranks > 1 and "--tensor-parallel-size" not in argv:  # a replica's GPUs: its TP ranks
            argv += ["--tensor-parallel-size", str(ranks)]
        url = f"http://{cfg.server_host}:{p}"
        specs.append(ChildSpec(s.name, argv, child_env, url, logs / f"{s.name}.log", s.role))

    def urls(role: str) -> str:
        return ",".join(c.url for c in specs if c.role == role)

    router_argv = [
        *py,
        "router",
        *("--host", cfg.host, "--port", str(rport)),
        *("--prefill", urls("prefill"), "--decode", urls("decode")),
        *cfg.router_args,
    ]
    rhost = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    specs.append(
        ChildSpec(
            "router", router_argv, dict(base_env), f"http://{rhost}:{rport}", logs / "router.log"
        )
    )
    return specs
