"""A GGUF model's tokenizer, converted once and kept on disk.

transformers builds a tokenizer from GGUF metadata by converting the vocabulary and merges, ~10 s
of CPU for SmolLM2's 49k tokens, in every API and engine process that starts. The converted
tokenizer saved with `save_pretrained` loads in about a second and encodes the same. The cache
entry is keyed by the GGUF file (path, size, mtime) and the transformers version, and is written
to a temporary directory first and renamed into place, so a reader never sees half an entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from kvrelay.config import env

log = logging.getLogger("kvrelay.tokenizer")


def _entry(gguf_path: str) -> Path | None:
    root = env("KVRELAY_CACHE_DIR")
    if root.strip().lower() == "off":
        return None
    import transformers

    st = os.stat(gguf_path)
    key = f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return Path(root).expanduser() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def gguf_tokenizer(model_dir: str, gguf_file: str):
    entry = _entry(os.path.join(model_dir, gguf_file))
    if entry is not None and entry.is_dir():
        return _load_entry(entry)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
    if entry is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-")
            tok.save_pretrained(tmp)
            try:
                os.rename(tmp, entry)
            except OSError:  # another process put the same entry there first
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as e:  # a read-only home: convert every time, as before
            log.warning(
                "tokenizer cache not written (%s); the tokenizer is converted each start", e
            )
    return tok


def _load_entry(entry: Path):
    """The saved tokenizer, through the class it was saved from where transformers exports it:
    AutoTokenizer's module imports torch (through transformers' model configs), ~1.6 s of CPU
    in an API process that needs none; for an entry of ours AutoTokenizer picks that class."""
    import transformers

    config = json.loads((entry / "tokenizer_config.json").read_text())
    cls = getattr(transformers, config.get("tokenizer_class") or "", None)
    if cls is None or cls.__name__ not in _DIRECT:
        return transformers.AutoTokenizer.from_pretrained(entry)
    return cls.from_pretrained(entry)


# Saved classes AutoTokenizer loads as themselves from a directory without a model config.
_DIRECT = ("TokenizersBackend",)
