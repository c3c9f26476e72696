"""The official `openai` client against a live `kvrelay serve` process."""

from __future__ import annotations

import openai
import pytest

MODEL = "smollm2"
MSG = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=24, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content.strip()
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_max_tokens_gives_length(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, max_completion_tokens=3, temperature=0
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_completion(client):
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert "Paris" in r.choices[0].text
    assert r.usage.completion_tokens == 6


def test_chat_stream_reassembles_to_the_whole_answer(client):
    whole = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=40, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_stream_reassembles(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    assert (
        "".join(
            c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices
        )
        == whole
    )


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-6)
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True
        )


def test_completion_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)


def test_stop_string_truncates(client):
    base = (
        client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0)
        .choices[0]
        .text
    )
    assert " 6" in base
    r = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 6"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.index(" 6")]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL,
            prompt="1, 2, 3, 4,",
            max_tokens=20,
            temperature=0,
            stop=[" 6"],
            stream=True,
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_seed_reproducibility(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=24,
        temperature=1.0,
    )
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    others = {
        client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)
    }
    assert a == b
    assert len(others | {a}) > 1  # different seeds really sample differently


def test_n_samples_are_the_seeded_single_requests(client):
    """n=3 with a seed: choice i is what a single request with seed + i samples (each sample
    is its own engine request), usage counts the prompt once and every completion."""
    kw = dict(model=MODEL, messages=MSG, max_tokens=8, temperature=1.0)
    r = client.chat.completions.create(n=3, seed=7, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(seed=7 + i, **kw) for i in range(3)]
    assert [c.message.content for c in r.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in r.choices}) > 1  # three seeds, three samples
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_n_samples_stream_by_index(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=3, n=2)
    whole = client.completions.create(**kw)
    texts = ["", ""]
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in whole.choices]


def test_n_beyond_16_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, n=17)
    assert e.value.body["param"] == "n"
