"""Prompt logprobs through the PD router: prefill runs the prompt, so it scores it (the engine's
prompt logprobs, in the prefill's own forward) and answers them in its HTTP reply; decode
never runs the prompt and answers without them (server/request_building.py
`scored_elsewhere`). The router puts prefill's prompt part into decode's answer, which then
equals one server's:

- completions `echo` with `logprobs`: the first `prompt_tokens` entries of prefill's
  `choices[0].logprobs` lead decode's (whose offsets already start after the echoed prompt);
  streamed, in the first chunk, where one server puts them;
- vLLM's `prompt_logprobs`: completions per choice, chat beside the choices;
- SGLang's `/generate` `input_token_logprobs` / `input_top_logprobs` (in every streamed event).
"""

from __future__ import annotations

import json
from collections.abc import Callable

LEGACY_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
SGLANG_INPUT = ("input_token_logprobs", "input_top_logprobs")


def needed(path: str, body: dict) -> bool:
    """Whether this (one-prompt, n=1) request's answer needs prefill's prompt scores."""
    if path == "/generate":
        start = body.get("logprob_start_len", -1)
        return bool(body.get("return_logprob")) and isinstance(start, int) and start >= 0
    if body.get("prompt_logprobs") is not None:
        return True
    return path == "/v1/completions" and bool(body.get("echo")) and body.get("logprobs") is not None


def _prompt_part(prefill: dict) -> dict | None:
    """The prompt's entries of prefill's legacy logprobs (it also shows its one token)."""
    lp = prefill["choices"][0].get("logprobs")
    if lp is None:
        return None
    n = prefill["usage"]["prompt_tokens"]
    return {k: lp[k][:n] for k in LEGACY_KEYS}


def _merge_choice(choice: dict, prefill: dict, echo: bool) -> None:
    pre = prefill["choices"][0]
    if "prompt_logprobs" in pre:
        choice["prompt_logprobs"] = pre["prompt_logprobs"]
    part = _prompt_part(prefill) if echo else None
    if part is not None:
        mine = choice.get("logprobs") or dict.fromkeys(LEGACY_KEYS, [])
        choice["logprobs"] = {k: part[k] + mine[k] for k in LEGACY_KEYS}


def merge_body(path: str, body: dict, decode: bytes, prefill: bytes) -> bytes:
    """Decode's whole answer with prefill's prompt scores in it."""
    d, p = json.loads(decode), json.loads(prefill)
    if path == "/generate":
        for key in SGLANG_INPUT:
            if key in d["meta_info"]:
                d["meta_info"][key] = p["meta_info"].get(key)
    elif path == "/v1/chat/completions":
        d["prompt_logprobs"] = p.get("prompt_logprobs")
    else:
        for choice in d["choices"]:
            _merge_choice(choice, p, bool(body.get("echo")))
    return json.dumps(d).encode()


def event_patcher(path: str, body: dict, prefill: bytes) -> Callable[[str], str]:
    """A function of decode's SSE lines that puts prefill's prompt scores in: SGLang's every
    event, completions' first chunk (streamed prompt_logprobs are refused, as vLLM does)."""
    p = json.loads(prefill)
    done = False

    def patch(line: str) -> str:
        nonlocal done
        if done or not line.startswith("data: {"):
            return line
        event = json.loads(line[6:])
        if "error" in event:
            return line
        if path == "/generate":
            for key in SGLANG_INPUT:
                if key in event.get("meta_info", {}):
                    event["meta_info"][key] = p["meta_info"].get(key)
        elif event.get("choices"):
            _merge_choice(event["choices"][0], p, bool(body.get("echo")))
            done = True
        else:
            return line
        return "data: " + json.dumps(event)

    return patch
