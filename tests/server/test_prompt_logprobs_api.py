"""Prompt logprobs over real HTTP with the official `openai` client (the embedded SmolLM2, whose
server prefills 128 tokens per step, so long prompts are scored across chunks): echo with
logprobs in the OpenAI legacy shape, max_tokens 0 and 1, streaming, vLLM's `prompt_logprobs`,
a concurrent mix with plain requests, and lm-eval's loglikelihood request as lm-eval sends it.

The values themselves are checked against HF transformers' full forward in
tests/engine/test_prompt_logprobs.py; here the prefill's scores of generated text must also equal
the logprobs the decode steps gave those tokens (two independent paths through the model).
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

MODEL = "smollm2"
FACTS = [f"Fact {i}: the river number {i} flows into the sea of {i + 1}." for i in range(9)]
LONG = " ".join(FACTS)  # ~150 tokens: two chunks of the server's 128-token prefill budget


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _check_legacy(lp, n_prompt: int, k: int, generated: int = 0) -> None:
    n = n_prompt + generated
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for x, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert x <= 0 and 0 < len(top) <= k
        assert max(top.values()) >= x  # the best alternative is at least as likely


def test_echo_max_tokens_0_scores_a_chunked_prompt(client):
    r = client.completions.create(
        model=MODEL,
        prompt=LONG,
        echo=True,
        max_tokens=0,
        logprobs=2,
        temperature=0,
        extra_body={"prompt_logprobs": 2},
    )
    c, n = r.choices[0], r.usage.prompt_tokens
    assert n > 128  # scored across two prefill chunks
    assert c.text == LONG and c.finish_reason == "length" and r.usage.completion_tokens == 0
    _check_legacy(c.logprobs, n, 2)
    assert "".join(c.logprobs.tokens) == LONG
    # vLLM's shape on the same request: the same numbers, keyed by token id, with ranks.
    vllm = c.model_extra["prompt_logprobs"]
    assert len(vllm) == n and vllm[0] is None
    for x, entry in zip(c.logprobs.token_logprobs[1:], vllm[1:], strict=True):
        tok = next(iter(entry.values()))  # the prompt token first, then the top 2
        assert tok["logprob"] == x and tok["rank"] >= 1 and tok["decoded_token"]
        assert len(entry) <= 3 and {1, 2} <= {a["rank"] for a in entry.values()}


def test_prefill_scores_equal_the_decode_steps_logprobs(client, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode("The three primary colours are", add_special_tokens=False)
    gen = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, logprobs=0, temperature=0
    ).choices[0]
    new_ids = smollm2_tokenizer.encode(gen.text, add_special_tokens=False)
    echo = client.completions.create(
        model=MODEL, prompt=prompt + new_ids, echo=True, max_tokens=0, logprobs=0, temperature=0
    ).choices[0]
    if echo.logprobs.tokens[len(prompt) :] != gen.logprobs.tokens:
        pytest.skip("the generated text does not re-tokenize to the generated tokens")
    scored = echo.logprobs.token_logprobs[len(prompt) :]
    assert scored == pytest.approx(gen.logprobs.token_logprobs, abs=2e-4)


def test_echo_max_tokens_1_and_its_stream(client):
    kw = dict(model=MODEL, prompt="Once upon a time", echo=True, logprobs=3, temperature=0)
    whole = client.completions.create(max_tokens=1, **kw)
    c = whole.choices[0]
    n = whole.usage.prompt_tokens
    assert whole.usage.completion_tokens == 1 and c.text.startswith("Once upon a time")
    lp = c.logprobs
    _check_legacy(lp, n, 3, generated=1)
    assert lp.text_offset[n] == len("Once upon a time")
    # Streamed: the prompt's text and logprobs lead the first chunk; the rest reassembles.
    text, tokens, lps = "", [], []
    for chunk in client.completions.create(stream=True, max_tokens=4, **kw):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs:
                tokens += ch.logprobs.tokens
                lps += ch.logprobs.token_logprobs
    ref = client.completions.create(max_tokens=4, **kw).choices[0]
    assert text == ref.text and tokens == ref.logprobs.tokens
    assert lps[0] is None and lps[1:] == pytest.approx(ref.logprobs.token_logprobs[1:], abs=1e-5)


def test_chat_prompt_logprobs_in_vllm_shape(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 0},
    )
    pl = r.model_extra["prompt_logprobs"]  # beside the choices, as vLLM puts it on chat
    assert len(pl) == r.usage.prompt_tokens and pl[0] is None
    for entry in pl[1:]:
        ((tid, tok),) = entry.items()  # k=0: the prompt token alone
        assert int(tid) >= 0 and tok["logprob"] <= 0 and tok["rank"] >= 1


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens"),
    ],
)
def test_refusals_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_concurrent_echo_beside_plain_requests(server, client):
    # Together the prompts exceed one step's 128 tokens: prefill chunks share steps with decode.
    plain = [dict(prompt=f"Write a sentence about {t}.", max_tokens=5) for t in ("tea", "jazz")]
    echo = [
        dict(prompt=f"{' '.join(FACTS[:3])} Topic {t}.", echo=True, max_tokens=1, logprobs=1)
        for t in ("tea", "jazz")
    ]
    reqs = [
        dict(model=MODEL, temperature=0, **kw)
        for pair in zip(plain, echo, strict=True)
        for kw in pair
    ]
    alone = [client.completions.create(**kw).choices[0] for kw in reqs]

    async def together():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(c.completions.create(**kw) for kw in reqs))

    for kw, got, ref in zip(reqs, asyncio.run(together()), alone, strict=True):
        g = got.choices[0]
        assert g.text == ref.text  # plain outputs unchanged by their scoring neighbours
        if kw.get("echo"):
            assert g.logprobs.tokens == ref.logprobs.tokens
            assert g.logprobs.token_logprobs[0] is None
            assert g.logprobs.token_logprobs[1:] == pytest.approx(
                ref.logprobs.token_logprobs[1:], abs=1e-4
            )
        else:
            assert g.logprobs is None and "prompt_logprobs" not in (g.model_extra or {})


def test_lm_eval_loglikelihood_request_prefers_paris(server, smollm2_tokenizer):
    """lm-eval's `local-completions` loglikelihood: context and continuation tokenized apart,
    sent as one token-id prompt (a batch of one), scored from token_logprobs[ctxlen:-1]."""
    enc = smollm2_tokenizer.encode
    context = enc("The capital of France is", add_special_tokens=False)
    scores = {}
    for cont in (" Paris", " banana"):
        ids = context + enc(cont, add_special_tokens=False)
        body = {
            "model": MODEL,
            "prompt": [ids],
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        }
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1
        ctxlen = len(context)
        continuation = lp["token_logprobs"][ctxlen:-1]
        tops = lp["top_logprobs"][ctxlen:-1]
        greedy = all(x == max(top.values()) for x, top in zip(continuation, tops, strict=True))
        scores[cont] = (sum(continuation), greedy)
    assert scores[" Paris"][0] > scores[" banana"][0] + 3
    assert scores[" Paris"][1] and not scores[" banana"][1]
