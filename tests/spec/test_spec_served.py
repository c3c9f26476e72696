"""`kvrelay serve --speculative-algorithm ngram` against the plain shared `server` (the same
SmolLM2 settings, float32 on CPU, prefix cache on), over real HTTP with the official openai
client: tool-calling-like conversations give the plain answers token for token with the same
logprobs at concurrency 1 and 8 while drafts are accepted (/metrics), and so do stop strings and
max_tokens cutting a copied span, n > 1, and grammar-constrained requests (which decode plainly:
a draft never bypasses the grammar)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from agent_turns import (
    MODEL,
    NUM_CONVERSATIONS,
    TOOLS,
    assert_same,
    client,
    conversation,
    pick,
    plain_turns,
    two_turns,
)
from conftest import ServerProcess

# The shared `server`'s settings, speculating.
SPEC_ARGS = (
    "--model", "smollm2", "--max-total-tokens", "65536", "--max-num-batched-tokens", "128",
    "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4",
)  # fmt: skip
ACCEPTED = "kvrelay_spec_decode_num_accepted_tokens_total"
COPY = (
    "Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape, "
    "honeydew, kiwi, lemon, mango.\nCopy: apple,"
)


@pytest.fixture(scope="module")
def spec():
    s = ServerProcess(*SPEC_ARGS)
    yield s
    s.close()


@pytest.mark.parametrize("convs", [[0], list(range(NUM_CONVERSATIONS))], ids=["c1", "c8"])
def test_conversations_equal_plain_decoding(server, spec, convs):
    want = pick(plain_turns(server.url), convs)
    before = spec.metric(ACCEPTED)
    got = two_turns(spec.url, [conversation(i) for i in convs], len(convs), want[: len(convs)])
    assert_same(want, got)
    assert spec.metric(ACCEPTED) > before  # drafts were accepted
    assert spec.metric("kvrelay_spec_decode_num_draft_tokens_total") >= spec.metric(ACCEPTED)
    assert spec.metric('kvrelay_spec_decode_num_accepted_tokens_per_pos_total{position="0"}') > 0
    drafts = spec.metric("kvrelay_spec_decode_num_drafts_total")
    print(f"mean accepted length {1 + spec.metric(ACCEPTED) / drafts:.2f} over {drafts:.0f} drafts")


def _completion(c, kw: dict) -> list:
    r = c.completions.create(
        model=MODEL, prompt=COPY, logprobs=1, **{"max_tokens": 24, "temperature": 0, **kw}
    )
    choices = [
        (x.text, x.finish_reason, x.logprobs.tokens, x.logprobs.token_logprobs) for x in r.choices
    ]
    return [*choices, r.usage.completion_tokens]


CUTS = [
    {"stop": [" fig"]},  # a stop string inside the copied span
    {"stop": ["grape,", "zzz"]},
    {"max_tokens": 7},  # the limit inside the span
    {"max_tokens": 11},
    {"n": 3},  # n samples of one prompt (the prefix cache shares it)
]


def _cuts(url: str) -> list:
    c = client(url)
    with ThreadPoolExecutor(len(CUTS)) as ex:  # in one batch
        return list(ex.map(lambda kw: _completion(c, kw), CUTS))


def test_stop_strings_max_tokens_and_n_samples_equal_plain_decoding(server, spec):
    want = _cuts(server.url)
    before = spec.metric(ACCEPTED)
    got = _cuts(spec.url)
    assert spec.metric(ACCEPTED) > before
    for kw, w, g in zip(CUTS, want, got, strict=True):
        assert g[-1] == w[-1], kw  # tokens counted
        for (wt, wf, wtok, wlp), (gt, gf, gtok, glp) in zip(w[:-1], g[:-1], strict=True):
            assert (gt, gf, gtok) == (wt, wf, wtok), kw
            assert glp == pytest.approx(wlp, abs=1e-4), kw


def test_sampling_with_n_and_a_seed_runs(spec):
    got = _completion(client(spec.url), {"temperature": 0.8, "seed": 5, "n": 2, "max_tokens": 16})
    assert len(got) == 3 and got[-1] <= 32
    assert all(f in ("stop", "length") and len(lp) == len(t) for _, f, t, lp in got[:-1])


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _constrained(url: str) -> list:
    c = client(url)
    msgs = [{"role": "user", "content": "Give a person called Ann, aged 31, as JSON. " * 3}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    forced = {"type": "function", "function": {"name": "get_forecast"}}

    def schema():
        r = c.chat.completions.create(
            model=MODEL, messages=msgs, response_format=fmt, max_tokens=24, temperature=0
        )
        return r.choices[0].message.content, r.choices[0].finish_reason

    def tool():
        r = c.chat.completions.create(
            model=MODEL, messages=conversation(2)[:2], tools=TOOLS, tool_choice=forced,
            parallel_tool_calls=False, max_tokens=40, temperature=0,
        )  # fmt: skip
        ch = r.choices[0]
        calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        return calls, ch.finish_reason

    with ThreadPoolExecutor(2) as ex:  # beside each other in one batch
        return [f.result() for f in (ex.submit(schema), ex.submit(tool))]


def test_grammar_constrained_requests_equal_plain_decoding(server, spec):
    want = _constrained(server.url)
    got = _constrained(spec.url)
    assert got == want
    assert json.loads(got[0][0])["age"] == 31  # the schema held
    assert got[1][1] == "tool_calls" and got[1][0][0][0] == "get_forecast"
