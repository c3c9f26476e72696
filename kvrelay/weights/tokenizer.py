"""The model's HF tokenizer, loaded from its source: a tokenizer directory, or the GGUF file's
vocabulary (converted once and kept on disk, tokenizer_cache.py). Below engine/ and server/:
the API process and the engine's grammar matchers load the same one."""

from __future__ import annotations

from kvrelay.weights.source import ModelSource
from kvrelay.weights.tokenizer_cache import gguf_tokenizer


def load_tokenizer(src: ModelSource):
    if src.tokenizer_gguf:
        return gguf_tokenizer(src.tokenizer_dir, src.tokenizer_gguf)
    from transformers import AutoTokenizer  # imports torch: only where it is needed

    return AutoTokenizer.from_pretrained(src.tokenizer_dir)
