"""Checkpoint readers: GGUF, HF safetensors directories, and dummy (random) weights."""
