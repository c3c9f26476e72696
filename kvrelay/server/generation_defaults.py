"""Sampling defaults for the fields a request leaves out, as vLLM does: the model's own (its HF
`generation_config.json`, or the model card's recommendation for the embedded SmolLM2), or, with
`--generation-config openai`, the plain OpenAI defaults."""

from __future__ import annotations

import json
import logging
import os

from kvrelay.weights.source import EMBEDDED, ModelSource

log = logging.getLogger("kvrelay.api")

OPENAI = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
# The SmolLM2-Instruct model card's recommendation; at temperature 1 the 135M model rambles.
SMOLLM2_CARD = {"temperature": 0.2, "top_p": 0.9}
_VALID = {
    "temperature": lambda v: isinstance(v, int | float) and 0.0 <= v <= 2.0,
    "top_p": lambda v: isinstance(v, int | float) and 0.0 < v <= 1.0,
    "top_k": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= -1,
    "min_p": lambda v: isinstance(v, int | float) and 0.0 <= v <= 1.0,
}


def model_defaults(mode: str, src: ModelSource) -> dict[str, float | int]:
    """`mode`: "auto" (the model's defaults), "openai" (none), or a directory holding a
    generation_config.json. Only the fields kvrelay samples with are taken."""
    if mode == "openai":
        return {}
    if mode == "auto":
        if src.kind == "gguf" and src.name == EMBEDDED:
            found = dict(SMOLLM2_CARD)
        else:
            found = _read(src.path) if src.path and os.path.isdir(src.path) else {}
    else:
        if not os.path.isfile(os.path.join(mode, "generation_config.json")):
            raise ValueError(f"--generation-config {mode}: no generation_config.json there")
        found = _read(mode)
    if found:
        log.info(
            "sampling defaults from the model (a request's own values win; "
            "--generation-config openai turns them off): %s",
            " ".join(f"{k}={v}" for k, v in sorted(found.items())),
        )
    return found


def _read(folder: str) -> dict[str, float | int]:
    path = os.path.join(folder, "generation_config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    out = {}
    for key, ok in _VALID.items():
        if key in cfg and cfg[key] is not None:
            if ok(cfg[key]):
                out[key] = cfg[key]
            else:
                log.warning("ignoring %s=%r from %s: out of range", key, cfg[key], path)
    return out


def resolve(req, defaults: dict[str, float | int]) -> dict[str, float | int]:
    """temperature, top_p, top_k, min_p for `req`: its own values, else the model's, else
    OpenAI's."""
    out = {}
    for key, openai_default in OPENAI.items():
        value = getattr(req, key, None)
        out[key] = value if value is not None else defaults.get(key, openai_default)
    out["top_k"] = max(int(out["top_k"]), 0)  # -1 and 0 both mean off
    return out
