"""The official openai client against a server or router: one request spec -> comparable result."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest


def _result(text: str, finish, usage, lps) -> dict:
    return {
        "text": text,
        "finish": finish,
        "n": usage.completion_tokens if usage else None,
        "prompt_n": usage.prompt_tokens if usage else None,
        "lps": lps,
    }


def run_spec(client: openai.OpenAI, model: str, spec: dict) -> dict:
    """Run one spec (completion or chat, streaming or not) and collect text, finish, usage and
    logprobs the same way for both."""
    kw = dict(model=model, max_tokens=spec["max_tokens"], temperature=0)
    stream = spec["stream"]
    if stream:
        kw.update(stream=True, stream_options={"include_usage": True})
    if spec["kind"] == "completion":
        if spec["logprobs"] is not None:
            kw["logprobs"] = spec["logprobs"]
        r = client.completions.create(prompt=spec["prompt"], **kw)
        if not stream:
            c = r.choices[0]
            lps = c.logprobs.token_logprobs if c.logprobs else None
            return _result(c.text, c.finish_reason, r.usage, lps)
        text, lps, finish, usage = "", [], None, None
        for ch in r:
            usage = ch.usage or usage
            for c in ch.choices:
                text += c.text
                finish = c.finish_reason or finish
                if c.logprobs:
                    lps += c.logprobs.token_logprobs
        return _result(text, finish, usage, lps or None)
    if spec["logprobs"]:
        kw.update(logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(
        messages=[{"role": "user", "content": spec["content"]}], **kw
    )
    if not stream:
        c = r.choices[0]
        lps = [x.logprob for x in c.logprobs.content] if c.logprobs else None
        return _result(c.message.content, c.finish_reason, r.usage, lps)
    text, lps, finish, usage = "", [], None, None
    for ch in r:
        usage = ch.usage or usage
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            if c.logprobs and c.logprobs.content:
                lps += [x.logprob for x in c.logprobs.content]
    return _result(text, finish, usage, lps or None)


def client(url: str, timeout: float = 300) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def run_specs(url: str, model: str, specs: list[dict]) -> list[dict]:
    """Every spec against `url` at once (one thread each); results in spec order."""
    c = client(url)
    with ThreadPoolExecutor(len(specs)) as ex:
        return list(ex.map(lambda s: run_spec(c, model, s), specs))


def assert_same_outputs(specs: list[dict], want: list[dict], got: list[dict], **tolerance) -> None:
    """Same text, finish reason and token count per spec; logprobs equal within `tolerance`
    (pytest.approx arguments), or absent on both."""
    for spec, w, g in zip(specs, want, got, strict=True):
        label = f"{spec['kind']} stream={spec['stream']} max_tokens={spec['max_tokens']}"
        assert g["text"] == w["text"], label
        assert g["finish"] == w["finish"] and g["n"] == w["n"], label
        if w["lps"] is None:
            assert g["lps"] is None, label
        else:
            assert g["lps"] == pytest.approx(w["lps"], **tolerance), label
