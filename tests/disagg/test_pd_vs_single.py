"""PD == single server, token for token: prefill + decode + router vs the shared single `server`.

Greedy decoding on CPU (fp32) is exactly reproducible, so every request sent through the router
(streaming and not, chat and completions, prompts shorter and longer than prefill's chunk) must
give the very tokens the single server gives, with the same logprobs; afterwards no KV page and no
request is left on either side.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from pd_stack import PDStack

MODEL = "smollm2"
STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
    "listening to the sea, and writing the weather into a leather notebook. "
)


@pytest.fixture(scope="module")
def pd():
    stack = PDStack()
    yield stack
    stack.close()


def _specs() -> list[dict]:
    specs = []
    prompts = [
        "The capital of France is",
        "1, 2, 3, 4,",
        "Write a list of fruits:",
        STORY * 3,  # ~100 tokens: two prefill chunks
        STORY * 6,  # ~200 tokens: longer than prefill's 64-token chunk
        STORY * 9,  # ~300 tokens: several chunks
    ]
    for i, p in enumerate(prompts):
        specs.append(
            {
                "kind": "completion",
                "prompt": p,
                "stream": i % 2 == 1,
                "max_tokens": 12 + 2 * i,
                "logprobs": 2 if i % 3 == 0 else None,
            }
        )
    chats = [
        "Name three colours of the rainbow.",
        "What is 2+2? Answer briefly.",
        STORY * 2 + "Summarise the story.",
        STORY * 6 + "What did the keeper write?",
    ]
    for i, c in enumerate(chats):
        specs.append(
            {
                "kind": "chat",
                "content": c,
                "stream": i % 2 == 0,
                "max_tokens": 16 + 4 * i,
                "logprobs": i % 2 == 1,
            }
        )
    return specs


def _run(client: openai.OpenAI, spec: dict) -> dict:
    kw = dict(model=MODEL, max_tokens=spec["max_tokens"], temperature=0)
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
            return {
                "text": c.text,
                "finish": c.finish_reason,
                "n": r.usage.completion_tokens,
                "lps": lps,
            }
        text, lps, finish, n = "", [], None, None
        for ch in r:
            if ch.usage:
                n = ch.usage.completion_tokens
            for c in ch.choices:
                text += c.text
                finish = c.finish_reason or finish
                if c.logprobs:
                    lps += c.logprobs.token_logprobs
        return {"text": text, "finish": finish, "n": n, "lps": lps or None}
    if spec["logprobs"]:
        kw.update(logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(
        messages=[{"role": "user", "content": spec["content"]}], **kw
    )
    if not stream:
        c = r.choices[0]
        lps = [x.logprob for x in c.logprobs.content] if c.logprobs else None
        return {
            "text": c.message.content,
            "finish": c.finish_reason,
            "n": r.usage.completion_tokens,
            "lps": lps,
        }
    text, lps, finish, n = "", [], None, None
    for ch in r:
        if ch.usage:
            n = ch.usage.completion_tokens
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            if c.logprobs and c.logprobs.content:
                lps += [x.logprob for x in c.logprobs.content]
    return {"text": text, "finish": finish, "n": n, "lps": lps or None}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_pd_matches_single_server_token_for_token(pd, server):
    specs = _specs()
    single, router = _client(server.url), _client(pd.router.url)
    with ThreadPoolExecutor(len(specs)) as ex:
        want = list(ex.map(lambda s: _run(single, s), specs))
    with ThreadPoolExecutor(len(specs)) as ex:
        got = list(ex.map(lambda s: _run(router, s), specs))
    for spec, w, g in zip(specs, want, got, strict=True):
        label = f"{spec['kind']} stream={spec['stream']} max_tokens={spec['max_tokens']}"
        assert g["text"] == w["text"], label
        assert g["finish"] == w["finish"] and g["n"] == w["n"], label
        if w["lps"] is None:
            assert g["lps"] is None, label
        else:
            assert g["lps"] == pytest.approx(w["lps"], abs=1e-3), label
    pd.wait_idle()
    assert pd.router.metric("kvrelay_router_requests_total", '{outcome="error"}') == 0
    assert pd.router.metric("kvrelay_router_requests_total", '{outcome="ok"}') == len(specs)


def test_first_token_finishes_the_request(pd, server):
    """max_tokens=1: decode gets the first token from prefill and has nothing left to compute."""
    kw = dict(
        model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0, logprobs=1
    )
    w = _client(server.url).completions.create(**kw)
    g = _client(pd.router.url).completions.create(**kw)
    assert g.choices[0].text == w.choices[0].text and g.choices[0].finish_reason == "length"
    assert g.choices[0].logprobs.token_logprobs == pytest.approx(
        w.choices[0].logprobs.token_logprobs, abs=1e-3
    )
    pd.wait_idle()


def test_bad_request_is_a_400_through_the_router(pd):
    c = _client(pd.router.url)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="hi", max_tokens=2)
    pd.wait_idle()
