"""Batched prompts (issue 28 item 3): `/v1/completions` with a list of strings or of token-id
lists and SGLang's `/generate` with a list of texts or of input_ids answer every prompt, in
order (completions: choice index = prompt_i * n + sample_j, as vLLM and OpenAI number them),
usage summed over the prompts; streamed too, the index (SGLang: `index`) telling them apart.
lm-eval's batched loglikelihood request is replayed from a recording (fixtures/). Greedy
throughout, each batch compared with the same prompts sent alone."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

MODEL = "smollm2"
PROMPTS = ["1, 2, 3, 4,", "The capital of France is", "Roses are red, violets"]
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _alone(client, prompt, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)


def test_a_batch_answers_each_prompt_in_order_with_usage_summed(client, smollm2_tokenizer):
    alone = [_alone(client, p, max_tokens=4) for p in PROMPTS]
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(2 * len(PROMPTS)))
    for c in r.choices:  # index = prompt_i * n + sample_j
        assert c.text == alone[c.index // 2].choices[0].text and c.finish_reason == "length"
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    ids = [smollm2_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone]
    assert by_ids.usage.prompt_tokens == r.usage.prompt_tokens


def test_a_streamed_batch_is_told_apart_by_index(client):
    whole = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=5, temperature=0, n=2, logprobs=1
    )
    texts, lps, usage = {}, {}, None
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=5, temperature=0, n=2, logprobs=1, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    assert sorted(texts) == list(range(6))
    for c in whole.choices:
        assert texts[c.index] == c.text
        assert lps[c.index] == pytest.approx(c.logprobs.token_logprobs, abs=1e-4)
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == 30


def test_lm_eval_batched_loglikelihood_request(server):
    """lm-eval's recorded batch of 8 token-id prompts (echo, max_tokens 1, logprobs 1): eight
    choices in prompt order, each scored as the prompt alone is; the right continuations win."""
    fx = json.loads((FIXTURES / "lm_eval_loglikelihood_batch.json").read_text())
    body = fx["request"]
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text  # was a 400: "batched prompts are not supported"
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(8))
    scores = []
    for c, ids, ctxlen in zip(choices, body["prompt"], fx["ctxlens"], strict=True):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        alone = httpx.post(
            server.url + "/v1/completions", json={**body, "prompt": ids}, timeout=120
        ).json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"][1:] == pytest.approx(alone["token_logprobs"][1:], abs=1e-4)
        scores.append(sum(lp["token_logprobs"][ctxlen:-1]))  # lm-eval's parse_logprobs
    for right, wrong in zip(scores[::2], scores[1::2], strict=True):
        assert right > wrong
    # Scoring alone (max_tokens 0): the prompt's entries, nothing generated.
    r = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 0}, timeout=300)
    for c, ids in zip(r.json()["choices"], body["prompt"], strict=True):
        assert len(c["logprobs"]["token_logprobs"]) == len(ids) and c["finish_reason"] == "length"


def _generate(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, timeout=300)


def test_sglang_batch_of_texts_and_of_ids(server, smollm2_tokenizer):
    params = {"temperature": 0, "max_new_tokens": 4}
    alone = [_generate(server, text=p, sampling_params=params).json() for p in PROMPTS]
    batch = _generate(server, text=PROMPTS, sampling_params=params).json()
    assert isinstance(batch, list) and len(batch) == len(PROMPTS)
    assert [b["text"] for b in batch] == [a["text"] for a in alone]
    assert [b["output_ids"] for b in batch] == [a["output_ids"] for a in alone]
    assert len({b["meta_info"]["id"] for b in batch}) == len(PROMPTS)
    ids = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    by_ids = _generate(server, input_ids=ids, sampling_params=params).json()
    assert [b["output_ids"] for b in by_ids] == [a["output_ids"] for a in alone]
    body = {"text": PROMPTS, "sampling_params": params, "stream": True}
    last: dict[int, dict] = {}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=300) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    for event in map(json.loads, data[:-1]):
        last[event["index"]] = event
    assert [last[i]["text"] for i in range(len(PROMPTS))] == [a["text"] for a in alone]


@pytest.mark.parametrize(
    ("url", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, "prompt[1]"),
        ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], []]}, "prompt[1]"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 1025}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 100, "n": 11}, "n"),
        ("/generate", {"text": ["a", ""]}, "text[1]"),
        ("/generate", {"input_ids": [[1], []]}, "input_ids[1]"),
    ],
)
def test_an_empty_prompt_in_a_batch_is_named(server, url, body, param):
    r = httpx.post(server.url + url, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
