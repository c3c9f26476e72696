"""Schemathesis hooks for test_openapi_fuzz.py: generated bodies name the served model half the
time (so that they reach the engine, not only the model check) and ask for at most 2 tokens and 2
samples (so that a run stays short on a CPU)."""

from __future__ import annotations

import random

import schemathesis

MODEL = "smollm2"


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    rng = random.Random(repr(sorted(body, key=str)))
    if "model" in body and rng.random() < 0.5:
        body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > 2:
            body[key] = 2
    if "messages" in body or "prompt" in body:
        body.setdefault("max_tokens", 2)
    if isinstance(body.get("n"), int) and 2 < body["n"] <= 16:
        body["n"] = 2  # n up to 16 is valid; 2 exercises the same path for fewer tokens
    params = body.get("sampling_params")
    if isinstance(params, dict) and not (
        isinstance(params.get("max_new_tokens"), int) and params["max_new_tokens"] <= 2
    ):
        params["max_new_tokens"] = 2
    elif "text" in body or "input_ids" in body:
        body.setdefault("sampling_params", {"max_new_tokens": 2})
