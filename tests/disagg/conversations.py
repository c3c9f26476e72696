"""Two-turn chat conversations through a single server and a PD router, turn by turn: turn 2
resends turn 1 with its answer and a new question, so its prompt begins with turn 1's (the case a
prefix cache exists for). Checks PD == single token for token and counts the KV bytes each turn
moved and the tokens decode found in its prefix cache."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from openai_calls import client
from pd_stack import metrics

from kvrelay.models.presets import PRESETS

MODEL = "smollm2"
SYSTEM = (
    "You are the lighthouse keeper's assistant. You answer in one short sentence, you never "
    "make up facts, and you always mention the weather if it is known."
)
SENT = 'kvrelay_pd_transfer_bytes_total{backend="tcp",direction="sent"}'
DECODE_HITS = "kvrelay_prefix_cache_hit_tokens_total"


def token_bytes() -> int:
    """One prompt token's KV as it travels: every layer's K and V rows, fp32 on CPU."""
    c = PRESETS["smollm2-135m"]  # the embedded SmolLM2's shape
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4


def _ask(url: str, messages: list[dict], model: str = MODEL) -> dict:
    r = client(url).chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True
    )
    c = r.choices[0]
    return {
        "text": c.message.content,
        "lps": [x.logprob for x in c.logprobs.content],
        "prompt_n": r.usage.prompt_tokens,
        "cached": r.usage.prompt_tokens_details.cached_tokens,
    }


def _turn(url: str, convs: list[list[dict]], model: str = MODEL) -> list[dict]:
    with ThreadPoolExecutor(len(convs)) as ex:  # the conversations' turns run concurrently
        return list(ex.map(lambda m: _ask(url, m, model), convs))


def _same(want: list[dict], got: list[dict]) -> None:
    for w, g in zip(want, got, strict=True):
        assert g["text"] == w["text"] and g["prompt_n"] == w["prompt_n"]
        assert g["lps"] == pytest.approx(w["lps"], abs=1e-3)


def two_turns(
    pd, single_url: str, n: int, model: str = MODEL, system: str = SYSTEM
) -> tuple[list[dict], list[dict], dict]:
    """n conversations, two turns, through PD and the single server (equal token for token).
    Returns each turn's PD results and what turn 2 moved: {"bytes": KV bytes prefill sent,
    "hits": prompt tokens decode's prefix cache provided}."""
    convs = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Day {i}: {q}"}]
        for i, q in enumerate(["How was the sea?", "Any ships?", "Was it cold?", "Rain?"] * 2)
    ][:n]
    first = _turn(single_url, convs, model)
    first_pd = _turn(pd.router.url, convs, model)
    _same(first, first_pd)
    for m, a in zip(convs, first, strict=True):
        m += [{"role": "assistant", "content": a["text"]}, {"role": "user", "content": "Why?"}]
    want = _turn(single_url, convs, model)
    pd.wait_idle()
    before = metrics(pd.prefill.url), metrics(pd.decode.url)
    got = _turn(pd.router.url, convs, model)
    _same(want, got)
    pd.wait_idle()
    after = metrics(pd.prefill.url), metrics(pd.decode.url)
    moved = {
        "bytes": after[0][SENT] - before[0][SENT],
        "hits": after[1].get(DECODE_HITS, 0) - before[1].get(DECODE_HITS, 0),
    }
    return first_pd, got, moved
