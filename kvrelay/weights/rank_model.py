"""The model one tensor-parallel rank runs, with its weights (the registry's `rank_model`
entries: the runner asks for it by family)."""

from __future__ import annotations

import torch

from kvrelay.config import EngineConfig
from kvrelay.layers.parallel import TPGroup
from kvrelay.weights.dsv4_rank_load import load_rank
from kvrelay.weights.dsv4_tp import shard_model
from kvrelay.weights.loader import ModelSource, build_model


def dense_rank_model(
    cfg: EngineConfig, src: ModelSource, dtype: torch.dtype, device: torch.device, tp: TPGroup
) -> torch.nn.Module:
    """Each rank loads its shard of the heads and MLP columns."""
    return build_model(src, dtype, device, cfg.seed, cfg.max_model_len or 1 << 17, tp)


def dsv4_rank_model(
    cfg: EngineConfig, src: ModelSource, dtype: torch.dtype, device: torch.device, tp: TPGroup
) -> torch.nn.Module:
    a2a = cfg.ep_dispatch == "all-to-all"
    if tp.is_parallel and src.kind == "hf":  # read only this rank's slices
        return load_rank(
            src.path, src.config, dtype, device, tp, cfg.expert_parallel, ep_all_to_all=a2a
        )
    # Built whole (dummy weights: those of TP=1), then cut to this rank's part.
    model = build_model(src, dtype, device, cfg.seed)
    shard_model(model, tp, cfg.expert_parallel, a2a)
    if cfg.speculative.algorithm == "mtp":
        _mtp_weights(cfg, src, model)
    return model


def _mtp_weights(cfg: EngineConfig, src: ModelSource, model: torch.nn.Module) -> None:
    """Drafting with the MTP block needs its trained weights: the checkpoint's, or those of
    --speculative-draft-model-path (dummy models keep their random ones: the overhead bound)."""
    from kvrelay.weights.dsv4_load import load_mtp_block

    path = cfg.speculative.draft_model_path
    if path:
        load_mtp_block(model, path)
    elif src.kind == "hf" and not _has_mtp(src.path):
        raise ValueError(
            f"--speculative-algorithm mtp: the checkpoint {src.path} has no MTP block "
            "(give one with --speculative-draft-model-path)"
        )


def _has_mtp(path: str) -> bool:
    from kvrelay.weights.dsv4_checkpoint import Dsv4Checkpoint

    with Dsv4Checkpoint(path) as ckpt:
        return any(n.startswith(("mtp.", "model.mtp.")) for n in ckpt.index)
