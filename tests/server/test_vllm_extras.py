"""vLLM's extra request fields through the real `openai` client (`extra_body=`): each is honoured
(structured outputs, min_tokens, include_stop_str_in_output, truncate_prompt_tokens,
return_tokens_as_token_ids, continue_final_message) or refused with a 400 naming it, and
booleans are never taken as integers. Greedy wherever outputs are compared."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

MODEL = "smollm2"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
COUNT = "1, 2, 3, 4, 5,"  # greedy: " 6, 7, 8, ..."


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, max_tokens=12, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=extra.pop("messages", ASK), max_tokens=max_tokens, temperature=0,
        extra_body=extra,
    )  # fmt: skip


def complete(client, prompt=COUNT, max_tokens=5, **extra):
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra
    )


def refused(fn, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        fn()
    err = e.value.body
    assert err["param"] == param, err
    return err["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_choice": ["Lyon", "a.b|c (x)", "Paris"]},
        {"structured_outputs": {"choice": ["Lyon", "a.b|c (x)", "Paris"]}},
    ],
    ids=["guided_choice", "structured_outputs.choice"],
)
def test_choice_is_one_of_the_strings_verbatim(client, extra):
    r = chat(client, **extra)
    assert r.choices[0].message.content in ("Lyon", "a.b|c (x)", "Paris")


def test_regex_and_json_constrain_the_output(client):
    for extra in ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}):  # fmt: skip
        text = complete(client, prompt="Code:", max_tokens=8, **extra).choices[0].text
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", text), (extra, text)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    for extra in ({"guided_json": json.dumps(schema)}, {"structured_outputs": {"json": schema}}):
        r = chat(client, max_tokens=16, **extra)
        assert set(json.loads(r.choices[0].message.content)) == {"ok"}, extra


def test_two_constraints_and_unknown_forms_are_400s(client):
    rf = {"type": "json_object"}
    refused(lambda: chat(client, response_format=rf, guided_json={"type": "object"}), "guided_json")
    refused(lambda: chat(client, guided_regex="a", guided_choice=["a"]), "guided_regex")
    so = {"choice": ["a"], "regex": "a"}
    refused(lambda: chat(client, structured_outputs=so), "structured_outputs.regex")
    so = {"structural_tag": "{}"}
    refused(lambda: chat(client, structured_outputs=so), "structured_outputs.structural_tag")
    refused(lambda: complete(client, guided_regex="("), "guided_regex")
    refused(lambda: chat(client, guided_json="{not json"), "guided_json")
    refused(lambda: chat(client, guided_whitespace_pattern=" "), "guided_whitespace_pattern")


def test_token_ids_stop_tokens_and_min_tokens(client):
    """return_tokens_as_token_ids names the real ids: the first one as a stop token ends the
    output at once; min_tokens masks it (and EOS) until the output is long enough."""
    r = complete(client, max_tokens=3, logprobs=1, return_tokens_as_token_ids=True)
    lp = r.choices[0].logprobs
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp.tokens), lp.tokens
    assert all(re.fullmatch(r"token_id:\d+", t) for top in lp.top_logprobs for t in top)
    first = int(lp.tokens[0].split(":")[1])
    assert complete(client, stop_token_ids=[first]).usage.completion_tokens == 1
    r = complete(client, stop_token_ids=[first], min_tokens=4)
    assert r.usage.completion_tokens >= 4
    refused(lambda: complete(client, max_tokens=3, min_tokens=4), "min_tokens")

    c = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=2, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    for entry in c.choices[0].logprobs.content:
        assert re.fullmatch(r"token_id:\d+", entry.token)
        assert all(re.fullmatch(r"token_id:\d+", t.token) for t in entry.top_logprobs)


def test_min_tokens_holds_off_eos(client):
    msgs = [{"role": "user", "content": "Answer with one word: is the sky blue?"}]
    plain = chat(client, max_tokens=12, messages=msgs)
    n = plain.usage.completion_tokens
    assert plain.choices[0].finish_reason == "stop" and n < 10, plain  # EOS came early
    held = chat(client, max_tokens=12, messages=msgs, min_tokens=n + 2)
    assert held.usage.completion_tokens >= n + 2


def test_stop_strings_min_tokens_and_include_stop_str(client):
    plain = complete(client, stop=[","]).choices[0].text  # " 6"
    assert plain and "," not in plain
    kept = complete(client, stop=[","], include_stop_str_in_output=True).choices[0]
    assert kept.text == plain + "," and kept.finish_reason == "stop"
    later = complete(client, stop=[","], min_tokens=3, max_tokens=8).choices[0]
    assert later.text.startswith(plain + ",") and later.text.count(",") == 1, later.text
    assert later.finish_reason == "stop"


def test_truncate_prompt_tokens_keeps_the_last_ones(client):
    tail = list(range(300, 316))
    whole = complete(client, prompt=[7] * 24 + tail, max_tokens=3, truncate_prompt_tokens=16)
    alone = complete(client, prompt=tail, max_tokens=3)
    assert whole.usage.prompt_tokens == 16
    assert whole.choices[0].text == alone.choices[0].text
    r = chat(client, max_tokens=1, truncate_prompt_tokens=5)
    assert r.usage.prompt_tokens == 5
    refused(lambda: complete(client, truncate_prompt_tokens=0), "truncate_prompt_tokens")


def test_continue_final_message_continues_the_assistant_turn(client, smollm2_tokenizer):
    msgs = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    text = smollm2_tokenizer.apply_chat_template(
        msgs, continue_final_message=True, add_generation_prompt=False, tokenize=False
    )
    assert text.endswith("The capital of France is")
    want = complete(client, prompt=text, max_tokens=3)
    got = chat(client, max_tokens=3, messages=msgs, continue_final_message=True)
    assert got.choices[0].message.content == want.choices[0].text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    no_header = smollm2_tokenizer.apply_chat_template(
        ASK, add_generation_prompt=False, tokenize=False
    )
    r = chat(client, max_tokens=1, add_generation_prompt=False)
    assert r.usage.prompt_tokens == len(smollm2_tokenizer.encode(no_header))
    both = dict(continue_final_message=True, add_generation_prompt=True)
    refused(lambda: chat(client, messages=msgs, **both), "add_generation_prompt")
    refused(lambda: chat(client, continue_final_message=True), "continue_final_message")


def test_neutral_values_are_accepted(client):
    neutral = {
        "min_tokens": 0, "include_stop_str_in_output": False, "truncate_prompt_tokens": None,
        "continue_final_message": False, "return_tokens_as_token_ids": False,
        "guided_choice": None, "guided_json": None, "guided_regex": None,
        "structured_outputs": None, "add_generation_prompt": True,
    }  # fmt: skip
    assert chat(client, max_tokens=2, **neutral).choices[0].message.content
    del neutral["continue_final_message"], neutral["add_generation_prompt"]
    assert complete(client, max_tokens=2, **neutral).choices[0].text


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "top_k": True}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "temperature": False}, "temperature"),
        ("/v1/completions", {"prompt": [True, False]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": ASK, "min_tokens": True}, "min_tokens"),
        ("/v1/chat/completions", {"messages": ASK, "logprobs": 1}, "logprobs"),
        ("/generate", {"input_ids": [True, False]}, "input_ids"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": True}},
         "sampling_params.max_new_tokens"),
    ],
    ids=lambda x: x if isinstance(x, str) and not x.startswith("/") else None,
)  # fmt: skip
def test_a_boolean_is_not_an_integer(server, path, body, param):
    if path != "/generate":
        body = {"model": MODEL, **body}
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text
