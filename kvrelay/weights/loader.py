"""Build the model of a resolved `--model` (weights/source.py) with its weights: dense models
from GGUF, HF safetensors or dummy init; DeepSeek-V4 from its checkpoint or dummy init."""

from __future__ import annotations

import logging

import torch

from kvrelay.layers.parallel import SINGLE, TPGroup
from kvrelay.layers.rope import RotaryEmbedding
from kvrelay.models import registry
from kvrelay.weights import dsv4_checkpoint, dsv4_load, gguf_reader, hf_dir, weight_cache

# Re-exported: resolving was this module's job before source.py (torch-free) took it.
from kvrelay.weights.source import EMBEDDED, ModelSource, embedded_gguf, resolve  # noqa: F401

log = logging.getLogger("kvrelay.weights")


def build_model(
    src: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    max_positions: int = 1 << 17,
    tp: TPGroup = SINGLE,
):
    """The model of `src` on `device` with its weights (dummy ones for a preset); with a
    parallel `tp`, this rank's part of it (dense models only, so far)."""
    build = registry.family(src.config.architecture).load("build")
    if not tp.is_parallel:
        return build(src, dtype, device, seed, max_positions)
    return build(src, dtype, device, seed, max_positions, tp=tp)


def build_dense(
    src: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    max_positions: int,
    tp: TPGroup = SINGLE,
):
    cls = registry.model_class(src.config.architecture)
    with torch.device("meta"):
        model = cls(src.config) if not tp.is_parallel else cls(src.config, tp)
    kept = None  # a GGUF model's parameters as an earlier start left them (weight_cache.py)
    if src.kind == "gguf" and not tp.is_parallel:
        nbytes = sum(p.numel() for p in model.parameters()) * dtype.itemsize
        kept = weight_cache.entry_path(src.path, dtype, nbytes)
    state = weight_cache.load(kept, device) if kept is not None else None
    if state is not None:  # the mapped tensors become the parameters: nothing is copied
        try:
            model.load_state_dict(state, strict=True, assign=True)
            return _with_rotary(model.eval(), src, dtype, device, max_positions)
        except RuntimeError as e:  # another layout (a change in layers/): built and kept anew
            log.warning("weight cache entry does not fit path=%s (%s): rebuilding", kept, e)
            with torch.device("meta"):
                model = cls(src.config)
    model = _to_empty(model, device)
    if src.kind == "dummy" and tp.is_parallel:
        # The same full weights as one rank would draw, each cut to this rank's part on load.
        with torch.device("meta"):
            full = cls(src.config)
        model.load_weights(_dummy_hf_weights(full, seed, device))
    elif src.kind == "dummy":
        _init_dummy(model, seed)
    elif src.kind == "gguf":
        reader = gguf_reader.open_gguf(src.path)
        if tp.is_parallel:  # each rank dequantizes only the slices it keeps
            weights = gguf_reader.read_weights(reader, src.config, model.shard_range)
            model.load_weights(weights, presharded=True)
        else:
            model.load_weights(gguf_reader.read_weights(reader, src.config))
    else:
        if tp.is_parallel:  # each rank reads only the slices it keeps
            model.load_weights(hf_dir.read_weights(src.path, model.shard_range), presharded=True)
        else:
            model.load_weights(hf_dir.read_weights(src.path))
    model = model.to(dtype).eval()
    if kept is not None:
        weight_cache.save(kept, model)
    return _with_rotary(model, src, dtype, device, max_positions)


def _with_rotary(model, src: ModelSource, dtype, device, max_positions: int):
    c = src.config
    max_positions = min(c.max_position_embeddings, max_positions)
    model.rotary = RotaryEmbedding(
        c.head_dim, c.rope_theta, c.rope_scaling, max_positions, dtype, device
    )
    return model


def _to_empty(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model.to_empty(device=device)` without its `torch.empty_like` of meta tensors, which
    goes through torch's Python refs and imports sympy: ~0.5-2 s of every engine start on a
    small CPU machine. Same result: uninitialised storage of each tensor's shape, strides and
    dtype on `device`."""
    return model._apply(
        lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    )


def build_dsv4(
    src: ModelSource, dtype: torch.dtype, device: torch.device, seed: int, max_positions: int
):
    from kvrelay.models.deepseek_v4 import DeepseekV4ForCausalLM, init_dummy_weights

    with torch.device(device):  # not meta: the RoPE tables are computed at construction
        model = DeepseekV4ForCausalLM(src.config, dtype)
    if src.kind == "dummy":
        init_dummy_weights(model, seed)
    else:  # tensors are read, dequantized and copied in one at a time
        with dsv4_checkpoint.Dsv4Checkpoint(src.path) as ckpt:
            dsv4_load.load_checkpoint(model, ckpt)
    return model.eval()


def _dummy_hf_weights(full, seed: int, device: torch.device):
    """(HF name, full tensor) of the weights `_init_dummy` draws for the unsharded model `full`
    (on the meta device: only its names and shapes are read), one tensor at a time."""
    for name, p in full.named_parameters():
        gen = torch.Generator(device=device).manual_seed(seed)
        seed += 1
        t = torch.empty(p.shape, dtype=p.dtype, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02, generator=gen)
        yield from full.split_fused(name, t)


def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator(device=p.device).manual_seed(seed)
            seed += 1
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                # Scaled so that activations stay bounded and logits are not degenerate.
                p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02, generator=gen)
