"""The model's HF tokenizer, loaded from its source: a tokenizer directory, or the GGUF file's
vocabulary (converted once and kept on disk, tokenizer_cache.py). Below engine/ and server/:
the API process and the engine's grammar matchers load the same one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrelay.weights.tokenizer_cache import gguf_tokenizer

if TYPE_CHECKING:  # the loader imports torch: a router (through sglang_api) needs none of it
    from kvrelay.weights.loader import ModelSource


def load_tokenizer(src: ModelSource):
    from transformers import AutoTokenizer

    if src.tokenizer_gguf:
        return gguf_tokenizer(src.tokenizer_dir, src.tokenizer_gguf)
    return AutoTokenizer.from_pretrained(src.tokenizer_dir)
