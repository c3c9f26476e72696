"""`kvrelay serve --deterministic` through the official `openai` client: the same seed gives the
same sampled text and logprobs alone and among 8 concurrent requests (float32, the CPU default:
there a row's GEMV alone and GEMM in a batch differ without the mode)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
from conftest import SMOLLM2_DETERMINISTIC as ARGS

PROMPTS = [f"Tale number {i}: long ago, in a kingdom by the {w} sea," for i, w in
           enumerate(["grey", "warm", "cold", "wide", "dark", "calm", "blue", "vast"])]  # fmt: skip


def test_same_seed_same_text_at_concurrency_1_and_8(shared_servers) -> None:
    s = shared_servers.get({"det": ARGS})["det"]
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)

    def ask(i: int):
        r = client.completions.create(
            model="smollm2", prompt=PROMPTS[i], max_tokens=4, temperature=1.0, seed=100 + i,
            logprobs=1,
        )  # fmt: skip
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs

    alone = {i: ask(i) for i in (0, 5)}
    with ThreadPoolExecutor(8) as ex:
        together = list(ex.map(ask, range(8)))
    for i, want in alone.items():
        assert together[i] == want
