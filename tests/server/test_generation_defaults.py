"""Sampling defaults: a request that leaves temperature / top_p / top_k out gets the model's
(HF generation_config.json, or the embedded SmolLM2's model card: 0.2 / 0.9); what it gives
wins; `--generation-config openai` means the plain OpenAI defaults."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from kvrelay.server.generation_defaults import OPENAI, SMOLLM2_CARD, model_defaults, resolve
from kvrelay.server.schemas import CompletionRequest
from kvrelay.weights.loader import resolve as resolve_model


def _req(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **kw})


def test_the_embedded_model_uses_its_model_card():
    src = resolve_model("smollm2")
    assert model_defaults("auto", src) == SMOLLM2_CARD == {"temperature": 0.2, "top_p": 0.9}
    assert model_defaults("openai", src) == {}


def test_an_hf_generation_config_is_read(tmp_path):
    cfg = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "min_p": 7}
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
    src = dataclasses.replace(resolve_model("smollm2"), kind="hf", path=str(tmp_path))
    # min_p 7 is out of range: ignored (with a warning), not applied.
    assert model_defaults("auto", src) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert model_defaults(str(tmp_path), resolve_model("smollm2"))["top_k"] == 20
    with pytest.raises(ValueError):
        model_defaults(str(tmp_path / "nowhere"), src)


def test_request_values_win_over_defaults():
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert resolve(_req(), defaults) == {**defaults, "min_p": 0.0}
    assert resolve(_req(temperature=1.0, top_k=-1), defaults) == {
        "temperature": 1.0, "top_p": 0.95, "top_k": 0, "min_p": 0.0,
    }  # fmt: skip
    assert resolve(_req(temperature=0), {}) == {**OPENAI, "temperature": 0}
    assert resolve(_req(temperature=None), {}) == OPENAI  # null: not given


def _tokens(server, **kw) -> list[str]:
    body = {
        "model": "smollm2",
        "prompt": "Once upon a time",
        "max_tokens": 24,
        "ignore_eos": True,
        "seed": 1234,
        "logprobs": 0,
        **kw,
    }
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_live_omitted_fields_use_the_model_defaults(server):
    """With one seed, leaving the fields out samples exactly as the card's values do, and not as
    OpenAI's temperature 1 does."""
    omitted = _tokens(server)
    assert omitted == _tokens(server, temperature=0.2, top_p=0.9)
    assert omitted != _tokens(server, temperature=1.0, top_p=1.0)
    assert _tokens(server, temperature=1.0) == _tokens(server, temperature=1.0, top_p=0.9)
