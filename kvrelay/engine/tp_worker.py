"""Start a tensor-parallel rank: join the torch.distributed group; ranks > 0 then follow rank 0.

gloo on CPU, NCCL on GPU. Rank 0 (the engine process) starts the other ranks as processes of
their own (`python -m kvrelay.engine.tp_worker RANK ADDR PORT`, the config on stdin), builds the
whole engine (scheduler, sampler) on top of its runner; the other ranks build only a runner and
run the steps rank 0 broadcasts. Each follower dies with rank 0.
"""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys

import msgspec
import torch

from kvrelay.config import EngineConfig, env
from kvrelay.models import registry
from kvrelay.weights.loader import ModelSource, resolve


def init_distributed(rank: int, world: int, addr: str, port: int, device: str = "auto") -> None:
    import torch.distributed as dist

    use_nccl = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_nccl:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        "nccl" if use_nccl else "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=float(env("KVRELAY_TP_TIMEOUT_S"))),
    )


def follower_main(
    cfg: EngineConfig, rank: int, addr: str, port: int, src: ModelSource | None = None
) -> None:
    """A rank > 0: build this rank's runner, then run rank 0's steps until it says stop; then
    the process ends at once (exit code 0), as the engine does after a clean stop: the
    interpreter's teardown of torch.distributed's threads could abort (SIGABRT, "terminate called
    without an active exception", seen once on a CPU machine) after every step had succeeded."""
    from kvrelay.engine.process_setup import die_with_parent, exit_now, setup_logging
    from kvrelay.engine.runner import make_runner

    setup_logging()
    die_with_parent()
    threads = int(env("KVRELAY_CPU_THREADS"))
    if threads > 0:
        torch.set_num_threads(threads)
    init_distributed(rank, cfg.tensor_parallel_size, addr, port, cfg.device)
    import torch.distributed as dist

    try:
        runner = make_runner(cfg, src or resolve(cfg.model, cfg.load_format, cfg.tokenizer))
        runner.follow()
    finally:
        dist.destroy_process_group()
    exit_now()


def check_supported(cfg: EngineConfig, src: ModelSource) -> None:
    if cfg.tensor_parallel_size < 1:
        raise ValueError("--tensor-parallel-size must be at least 1")
    family = registry.family(src.config.architecture)
    if cfg.expert_parallel and family is not registry.DEEPSEEK_V4:
        raise ValueError("--expert-parallel is for DeepSeek-V4 (MoE) models")
    if cfg.tensor_parallel_size == 1:
        return
    if family is registry.DEEPSEEK_V4:  # refused before any follower starts
        from kvrelay.engine.runner import pick_device
        from kvrelay.models.deepseek_v4.runnable import check_parallel

        check_parallel(cfg, pick_device(cfg.device))
    elif family is not registry.DENSE:
        raise ValueError(f"tensor parallel does not serve {family.name} models yet")
    elif cfg.role != "single" and cfg.disagg.transfer_backend != "tcp":
        # cuda_ipc copies whole rows between rank 0's pages and the peer's; rank 0's pages hold
        # only its KV heads (tcp: prefill gathers every rank's heads, decode hands them out)
        raise ValueError(
            f"a dense model's tensor-parallel {cfg.role} role needs --transfer-backend tcp"
        )


def start_followers(cfg: EngineConfig) -> tuple[list[subprocess.Popen], int]:
    """Rank 0: start ranks 1..N-1 on this host; returns them and the rendezvous port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(1, cfg.tensor_parallel_size):
        p = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.engine.tp_worker", str(rank), "127.0.0.1", str(port)],
            stdin=subprocess.PIPE,
        )
        p.stdin.write(msgspec.json.encode(cfg))  # on stdin: the config may hold secrets
        p.stdin.close()
        procs.append(p)
    return procs, port


if __name__ == "__main__":
    _cfg = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    follower_main(_cfg, int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
