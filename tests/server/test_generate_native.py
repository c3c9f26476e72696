"""SGLang's native POST /generate: text or input_ids, SGLang's sampling parameter names, its
answer shape (text, output_ids, meta_info), streaming as SSE; what it cannot honour is a 400."""

from __future__ import annotations

import json

import httpx
import pytest

GREEDY = {"temperature": 0, "max_new_tokens": 6}


def _completion(server, prompt) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()


def test_text_matches_the_openai_completion(server):
    r = httpx.post(
        server.url + "/generate",
        json={"text": "The capital of France is", "sampling_params": GREEDY},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    d = r.json()
    assert set(d) == {"text", "output_ids", "meta_info"}
    m = d["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 6}
    assert m["completion_tokens"] == len(d["output_ids"]) == 6 and m["prompt_tokens"] > 0
    assert m["id"] and m["e2e_latency"] >= 0
    assert d["text"] == _completion(server, "The capital of France is")["choices"][0]["text"]


def test_input_ids_and_a_stop_string(server, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("The capital of France is")
    whole = httpx.post(
        server.url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}, timeout=60
    ).json()
    assert whole["text"] == _completion(server, ids)["choices"][0]["text"]
    stop = whole["text"][2:5]
    params = {**GREEDY, "stop": [stop]}
    (d,) = httpx.post(  # a batch of one: a list of one answer (as SGLang)
        server.url + "/generate", json={"input_ids": [ids], "sampling_params": params}, timeout=60
    ).json()
    assert d["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert d["text"] == whole["text"][: whole["text"].index(stop)]


def test_stream_is_sse_of_the_output_so_far_then_done(server):
    body = {
        "text": "The capital of France is",
        "sampling_params": GREEDY,
        "stream": True,
        "rid": "mine",
    }
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(x) for x in data[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative
    assert all(c["meta_info"]["id"] == "mine" for c in chunks)
    assert [c["meta_info"]["finish_reason"] for c in chunks][-1]["type"] == "length"
    whole = httpx.post(
        server.url + "/generate",
        json={"text": "The capital of France is", "sampling_params": GREEDY},
        timeout=60,
    ).json()
    assert texts[-1] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]


def test_structured_output(server):
    """sampling_params regex / json_schema / ebnf constrain the output (llguidance grammars)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    kinds = {
        "regex": " (yes|no)",
        "json_schema": json.dumps({**schema, "additionalProperties": False}),
        "ebnf": 'root ::= " " ("red" | "green" | "blue")',
    }
    out = {}
    for kind, grammar in kinds.items():
        params = {**GREEDY, "max_new_tokens": 8, kind: grammar}
        body = {"text": "Is the sky blue? Answer:", "sampling_params": params}
        r = httpx.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["finish_reason"]["type"] == "stop", r.text
        out[kind] = r.json()["text"]
    assert out["regex"] in (" yes", " no")
    assert set(json.loads(out["json_schema"])) == {"ok"}
    assert out["ebnf"] in (" red", " green", " blue")


@pytest.mark.parametrize(
    "body,param",
    [
        ({"sampling_params": GREEDY}, None),  # neither text nor input_ids
        ({"text": "x", "input_ids": [1]}, None),
        ({"text": ["a", ""]}, "text[1]"),  # a batch with an empty prompt
        ({"text": "x", "sampling_params": {"regex": "(a"}}, "sampling_params.regex"),
        ({"text": "x", "sampling_params": {"json_schema": "{no"}}, "sampling_params.json_schema"),
        ({"text": "x", "sampling_params": {"json_schema": '{"if": {}}'}}, "sampling_params.json_schema"),
        ({"text": "x", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "sampling_params.ebnf"),
        ({"text": "x", "sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
        ({"text": "x", "sampling_params": {"n": 2}}, "sampling_params.n"),
        ({"text": "x", "sampling_params": {"repetition_penalty": 1.2}}, "sampling_params.repetition_penalty"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 2**70}}, "sampling_params.max_new_tokens"),
        ({"text": "x", "sampling_params": {"sampling_seed": 2**70}}, "sampling_params.sampling_seed"),
        ({"text": "x", "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"text": "x", "return_logprob": True, "token_ids_logprob": [1]}, "token_ids_logprob"),
        ({"text": "x", "return_routed_experts": True}, "return_routed_experts"),
        ({"text": "x", "return_hidden_states": True}, "return_hidden_states"),
        ({"text": "x", "lora_path": "my-adapter"}, "lora_path"),
        ({"text": "x", "image_data": "http://x/y.png"}, "image_data"),
        ({"input_ids": [1, 2**40]}, "input_ids[1]"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400(server, body, param):
    r = httpx.post(server.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
