"""The two response shapes of prompt logprobs, from engine entries (no server)."""

from __future__ import annotations

import json
import math

import pytest

from kvrelay.engine.messages import PromptLogprob, TokenLogprob
from kvrelay.server import prompt_logprobs as plp


class Tok:
    def batch_decode(self, seqs, skip_special_tokens=False):
        return [f"<{s[0]}>" for s in seqs]


PROMPT = [5, 7, 9]
ENTRIES = [
    PromptLogprob(-0.5, 1, [TokenLogprob(7, -0.5), TokenLogprob(3, -1.5)]),
    PromptLogprob(-math.inf, 40, [TokenLogprob(1, -0.1), TokenLogprob(2, -2.5)]),
]


def test_legacy_shape_leads_with_a_null_and_clamps_infinity():
    lp = plp.legacy(Tok(), PROMPT, ENTRIES, k=1)
    assert lp["tokens"] == ["<5>", "<7>", "<9>"]
    assert lp["token_logprobs"] == [None, -0.5, plp.FLOOR]
    assert lp["top_logprobs"] == [None, {"<7>": -0.5}, {"<1>": -0.1}]
    assert lp["text_offset"] == [0, 3, 6]
    json.dumps(lp, allow_nan=False)  # valid JSON: no -Infinity
    gen = {"tokens": ["<2>"], "token_logprobs": [-1.0], "top_logprobs": [{}], "text_offset": [9]}
    assert plp.merge(lp, gen)["token_logprobs"] == [None, -0.5, plp.FLOOR, -1.0]


def test_vllm_shape_holds_the_prompt_token_and_the_top_k():
    out = plp.vllm(Tok(), PROMPT, ENTRIES)
    assert out[0] is None
    assert out[1] == {  # the prompt token is the top one: one entry, not two
        "7": {"logprob": -0.5, "rank": 1, "decoded_token": "<7>"},
        "3": {"logprob": -1.5, "rank": 2, "decoded_token": "<3>"},
    }
    assert list(out[2]) == ["9", "1", "2"] and out[2]["9"]["rank"] == 40
    assert out[2]["9"]["logprob"] == plp.FLOOR
    with pytest.raises(ValueError):
        plp.vllm(Tok(), PROMPT, ENTRIES[:1])
