"""Start a tensor-parallel rank: join the torch.distributed group; ranks > 0 then follow rank 0.

gloo on CPU, NCCL on GPU. Rank 0 builds the whole engine (scheduler, sampler) on top of its
runner; the other ranks build only a runner and run the steps rank 0 broadcasts.
"""

from __future__ import annotations

import datetime

import torch

from kvrelay.config import EngineConfig, env
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
    """A rank > 0: build this rank's runner, then run rank 0's steps until it says stop."""
    from kvrelay.engine.runner import make_runner

    init_distributed(rank, cfg.tensor_parallel_size, addr, port, cfg.device)
    import torch.distributed as dist

    try:
        runner = make_runner(cfg, src or resolve(cfg.model, cfg.load_format, cfg.tokenizer))
        runner.follow()
    finally:
        dist.destroy_process_group()
