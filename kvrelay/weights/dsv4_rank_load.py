"""Load one tensor-parallel rank of a DeepSeek-V4 checkpoint, reading only the slices it keeps.

The model is built on the `meta` device (shapes only), cut to the rank's shapes by the same
`shard_model` that cuts a loaded model, then allocated and filled slice by slice from the
checkpoint (`dsv4_sources`): each rank reads ~1/N of every split tensor and, with expert
parallel, only its own experts, so its peak memory is about its part. The values are those of
loading the whole model and cutting it (dequantizing a box gives the same numbers as
dequantizing the whole tensor).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from kvrelay.layers.parallel import TPGroup
from kvrelay.models.deepseek_v4.config import DeepseekV4Config
from kvrelay.weights.dsv4_checkpoint import CheckpointError, Dsv4Checkpoint
from kvrelay.weights.dsv4_load import PACKED_FIELDS
from kvrelay.weights.dsv4_shard import Slice
from kvrelay.weights.dsv4_sources import Sources
from kvrelay.weights.dsv4_tp import VOCAB, rank_slices, shard_model
from kvrelay.weights.tensor_source import SafetensorsReader, Source, box_with, full_box

log = logging.getLogger("kvrelay.weights")


class _WeightsOnMeta(TorchFunctionMode):
    """Parameters and buffers (made by these factories without a device) land on `meta`; the
    RoPE tables, computed at construction from `arange`, stay real."""

    _FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._FACTORIES and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialised) every meta parameter and buffer on `device`, ties kept."""
    done: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for key, t in store.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    new = torch.empty_like(t, device=device)
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    done[id(t)] = new
                store[key] = done[id(t)]


def read_part(src: Source, slices: list[Slice]) -> torch.Tensor:
    """The slices of `src` (whole when none), read box by box and concatenated."""
    if not slices:
        return src.read(full_box(src.shape))
    parts = [src.read(box_with(src.shape, d, a, b)) for d, a, b in slices]
    return parts[0] if len(parts) == 1 else torch.cat(parts, slices[0][0])


def read_into(dst: torch.Tensor, src: Source, slices: list[Slice], name: str) -> None:
    """The slices of `src` copied into their places in `dst`, box by box: no concatenated
    buffer (safetensors hands back views of its file mapping, so each box is one copy)."""
    if len(slices) < 2:
        return _fill(dst, read_part(src, slices), name)
    at = 0
    for d, a, b in slices:
        _fill(dst.narrow(d, at, b - a), src.read(box_with(src.shape, d, a, b)), name)
        at += b - a
    if at != dst.shape[slices[0][0]]:
        raise CheckpointError(f"{name}: rank part of {at} along dim {slices[0][0]}, {dst.shape}")


@torch.no_grad()
def load_rank(
    path: str,
    config: DeepseekV4Config,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup,
    expert_parallel: bool = False,
    reader: SafetensorsReader | None = None,
    ep_all_to_all: bool = False,
) -> nn.Module:
    """Rank `tp.rank`'s `DeepseekV4ForCausalLM` of the checkpoint directory `path`, equal to
    loading it whole and calling `shard_model`. Without an MTP block in the checkpoint the model
    has none (the whole-model path keeps a randomly initialised one, which serving never runs).
    """
    from kvrelay.models.deepseek_v4 import DeepseekV4ForCausalLM
    from kvrelay.models.deepseek_v4.experts import QuantizedExperts

    t0 = time.perf_counter()
    reader = reader or SafetensorsReader()
    with Dsv4Checkpoint(path) as ckpt:
        with_mtp = any(n.startswith(("mtp.", "model.mtp.")) for n in ckpt.index)
        with torch.device(device), _WeightsOnMeta():
            model = DeepseekV4ForCausalLM(config, dtype, with_mtp=with_mtp)
            # The whole shapes, before the cut: the sources are checked against them.
            whole = {n: tuple(t.shape) for n, t in model.state_dict().items()}
            shard_model(model, tp, expert_parallel, ep_all_to_all)  # new tables on meta too
        _materialize(model, device)
        own = model.state_dict()
        sources = Sources(ckpt, reader)
        wanted: dict[str, Source] = {}
        packed_paths = set()
        for mod_path, module in model.named_modules():
            if not isinstance(module, QuantizedExperts):
                continue
            kind, n = mod_path.removeprefix("model.").split(".")[:2]
            got = sources.packed(f"{kind}.{n}")
            if got is None:
                raise CheckpointError(f"{mod_path}: no routed experts in the checkpoint")
            fmt, fields = got
            if fmt != module.fp4_format:
                raise CheckpointError(
                    f"{mod_path}: the checkpoint's experts are {fmt}; the model holds "
                    f"{module.fp4_format}"
                )
            for buf, field in PACKED_FIELDS[fmt].items():
                wanted[f"{mod_path}.{buf}"] = fields[field]
            packed_paths.add(mod_path)
        wanted |= sources.dense(dtype, frozenset(packed_paths))
        seen = set()
        for name, src in wanted.items():
            if name not in own:
                raise CheckpointError(f"{name}: the model has no such parameter")
            if src.shape != whole[name]:
                raise CheckpointError(
                    f"{name}: checkpoint shape {src.shape} != model shape {whole[name]}"
                )
            read_into(
                own[name],
                src,
                rank_slices(name, src.shape, tp, expert_parallel, ep_all_to_all),
                name,
            )
            seen.add(name)
        reader.close()
    missing = set(own) - seen
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise CheckpointError(f"tensors missing from the checkpoint: {sorted(missing)[:8]}")
    log.info(
        "checkpoint rank loaded path=%s rank=%d/%d expert_parallel=%s tensors=%d seconds=%.2f",
        path, tp.rank, tp.world, expert_parallel, len(seen), time.perf_counter() - t0,
    )  # fmt: skip
    return model.eval()


def _fill(dst: torch.Tensor, t: torch.Tensor, name: str) -> None:
    if t.dtype in (torch.int8, torch.float8_e8m0fnu) and dst.dtype == torch.uint8:
        t = t.view(torch.uint8)  # packed FP4 codes and MXFP4 scales are kept as raw bytes
    if name in VOCAB and t.shape[0] < dst.shape[0]:  # the last rank's padding rows
        dst[t.shape[0] :].zero_()
        dst = dst[: t.shape[0]]
    if dst.shape != t.shape:
        raise CheckpointError(f"{name}: rank part {tuple(t.shape)} != {tuple(dst.shape)}")
    dst.copy_(t)
