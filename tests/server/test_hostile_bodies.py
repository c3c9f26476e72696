"""Hostile request bodies, as third-party clients send them: each is a 4xx OpenAI error naming
the field (streamed or not), counted in the metrics, and the server keeps serving. Errors of
routes that do not exist are OpenAI errors too; a stream that fails after it began ends in an
SSE error event and [DONE]."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _chat(**kw) -> dict:
    return {"model": "smollm2", "messages": MSG, "max_tokens": 4, **kw}


def _comp(**kw) -> dict:
    return {"model": "smollm2", "prompt": "Hi", "max_tokens": 4, **kw}


def _raw(obj: str) -> bytes:
    """A body json.dumps cannot write (NaN, lone surrogates): spelled out."""
    return obj.encode()


BIG = 2**70  # beyond int64
# (name, path, body, param the error must name; None: the body as a whole)
CASES = [
    ("seed beyond int64", CHAT, _chat(seed=BIG), "seed"),
    ("seed below int64", COMP, _comp(seed=-BIG), "seed"),
    ("seed fractional", CHAT, _chat(seed=1.5), "seed"),
    ("top_k beyond int64", CHAT, _chat(top_k=BIG), "top_k"),
    ("top_k below -1", COMP, _comp(top_k=-2), "top_k"),
    ("stop_token_ids beyond int64", CHAT, _chat(stop_token_ids=[BIG]), "stop_token_ids[0]"),
    ("stop_token_ids negative", CHAT, _chat(stop_token_ids=[3, -1]), "stop_token_ids[1]"),
    ("stop_token_ids outside vocab", COMP, _comp(stop_token_ids=[10**6]), "stop_token_ids[0]"),
    ("stop_token_ids not a list", CHAT, _chat(stop_token_ids=5), "stop_token_ids"),
    ("max_tokens beyond int64", CHAT, _chat(max_tokens=BIG), "max_tokens"),
    ("n beyond int64", CHAT, _chat(n=BIG), "n"),
    ("logprobs beyond range", COMP, _comp(logprobs=BIG), "logprobs"),
    ("top_logprobs beyond range", CHAT, _chat(logprobs=True, top_logprobs=BIG), "top_logprobs"),
    ("prompt token beyond int64", COMP, _comp(prompt=[1, 2, BIG]), "prompt[2]"),
    ("prompt token negative", COMP, _comp(prompt=[1, -2]), "prompt[1]"),
    (
        "tool_choice.function a string",
        CHAT,
        _chat(tools=TOOLS, tool_choice={"type": "function", "function": "f"}),
        "tool_choice.function",
    ),
    (
        "tool_choice.function a list",
        CHAT,
        _chat(tools=TOOLS, tool_choice={"type": "function", "function": ["f"]}),
        "tool_choice.function",
    ),
    (
        "tool_choice.function an int",
        CHAT,
        _chat(tools=TOOLS, tool_choice={"type": "function", "function": 7}),
        "tool_choice.function",
    ),
    ("tool_choice an int", CHAT, _chat(tools=TOOLS, tool_choice=3), "tool_choice"),
    (
        "tool_choice names no tool",
        CHAT,
        _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}),
        "tool_choice",
    ),
    ("tool_choice required without tools", CHAT, _chat(tool_choice="required"), "tool_choice"),
    ("tool function a string", CHAT, _chat(tools=[{"type": "function", "function": "f"}]), "tools[0].function"),
    ("tool without a name", CHAT, _chat(tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
    ("tools not a list", CHAT, _chat(tools={"f": 1}), "tools"),
    (
        "history tool call function a string",
        CHAT,
        _chat(messages=[*MSG, {"role": "assistant", "tool_calls": [{"function": "x"}]}, *MSG]),
        "messages[1].tool_calls[0].function",
    ),
    (
        "content part text an int",
        CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        "messages[0].content[0].text",
    ),
    (
        "content part an image",
        CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages",
    ),
    ("message content a number", CHAT, _chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    ("messages not a list", CHAT, _chat(messages="Hi"), "messages"),
    ("logit_bias given", CHAT, _chat(logit_bias={"42": 5}), "logit_bias"),
    ("repetition_penalty other than 1", COMP, _comp(repetition_penalty=1.3), "repetition_penalty"),
    ("best_of above 1", COMP, _comp(best_of=3), "best_of"),
    ("suffix given", COMP, _comp(suffix="tail"), "suffix"),
    ("temperature a string NaN", CHAT, _chat(temperature="nan"), "temperature"),
    ("temperature NaN", CHAT, _raw('{"model": "smollm2", "messages": [], "temperature": NaN}'), "temperature"),
    ("top_p Infinity", COMP, _raw('{"model": "smollm2", "prompt": "x", "top_p": Infinity}'), "top_p"),
    ("presence_penalty -Infinity", COMP, _raw('{"model": "smollm2", "prompt": "x", "presence_penalty": -Infinity}'), "presence_penalty"),
    ("a float overflowing a double", CHAT, _raw('{"model": "smollm2", "messages": [], "min_p": 1e999}'), "min_p"),
    (
        "lone surrogate in content",
        CHAT,
        _raw('{"model": "smollm2", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        "messages[0].content",
    ),
    ("lone surrogate in a prompt", COMP, _raw('{"model": "smollm2", "prompt": "\\udfff"}'), "prompt"),
    ("lone surrogate in stop", COMP, _raw('{"model": "smollm2", "prompt": "x", "stop": ["\\ud83d"]}'), "stop[0]"),
    ("lone surrogate in a key", CHAT, _raw('{"model": "smollm2", "messages": [], "\\ud800": 1}'), None),
    ("an integer of 5000 digits", COMP, _raw('{"model": "smollm2", "prompt": "x", "seed": ' + "9" * 5000 + "}"), None),
    ("nesting 100000 deep", CHAT, _raw('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"), None),
    ("nesting 65 deep", CHAT, _raw('{"x": ' + "[" * 65 + "]" * 65 + "}"), "x" + "[0]" * 63),
    ("invalid UTF-8", COMP, b'{"model": "smollm2", "prompt": "\xff\xfe"}', None),
    ("null body", CHAT, b"null", None),
    ("empty body", COMP, b"", None),
    ("model not a string", CHAT, _chat(model=["smollm2"]), "model"),
    ("stream not a bool", CHAT, _chat(stream="yes please"), "stream"),
    ("stream_options not an object", CHAT, _chat(stream=True, stream_options=[1]), "stream_options"),
    ("chat_template_kwargs not an object", CHAT, _chat(chat_template_kwargs=[]), "chat_template_kwargs"),
]  # fmt: skip


def _post(c: httpx.Client, path: str, body, stream: bool | None = None) -> httpx.Response:
    if isinstance(body, bytes):
        if stream and body.startswith(b"{") and len(body) < 10_000:
            body = b'{"stream": true, ' + body[1:]
        return c.post(path, content=body, headers={"Content-Type": "application/json"})
    return c.post(path, json={"stream": True, **body} if stream else body)


def _assert_openai_error(r: httpx.Response, param: str | None) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and err["type"] == "invalid_request_error", err
    assert err["param"] == param, err
    return err


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("name,path,body,param", CASES, ids=[c[0] for c in CASES])
def test_hostile_body_is_a_4xx_naming_the_field(server, name, path, body, param, stream):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        _assert_openai_error(_post(c, path, body, stream), param)
        assert c.get("/health").status_code == 200


def test_hostile_bodies_are_counted_and_the_server_still_serves(server):
    def errors(status: str) -> float:
        try:
            return server.metric(f'kvrelay_request_errors_total{{status="{status}"}}')
        except KeyError:
            return 0.0

    before, before_5xx = errors("400"), errors("500")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for _, path, body, _ in CASES:
            assert _post(c, path, body).status_code == 400
        ok = c.post(CHAT, json=_chat(temperature=0))
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    assert errors("400") == before + len(CASES)
    assert errors("500") == before_5xx


def test_the_openai_client_gets_bad_request_with_param(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for kw, param in (
        ({"seed": BIG}, "seed"),
        ({"extra_body": {"top_k": BIG}}, "top_k"),
        ({"extra_body": {"stop_token_ids": [BIG]}}, "stop_token_ids[0]"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "f"}}, "tool_choice.function"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ):  # fmt: skip
        args = {"model": "smollm2", "messages": MSG, "max_tokens": 2, **kw}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**args)
        assert e.value.param == param, e.value.body
        with pytest.raises(openai.BadRequestError):  # a stream fails before it starts
            client.chat.completions.create(stream=True, **args)
    r = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_stream_failing_after_it_began_ends_in_an_error_event_and_done(server):
    """The engine refuses a prompt token outside the vocabulary once the stream has begun."""
    body = {"model": "smollm2", "prompt": [1, 2, 49_999], "max_tokens": 3, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", COMP, json=body) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events
        err = json.loads(events[-2])["error"]
        assert err["type"] == "invalid_request_error" and "vocabulary" in err["message"], err
        assert c.post(CHAT, json=_chat(temperature=0)).status_code == 200
    # The client library reads the event as an error, not as a dropped connection.
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="vocabulary"):
        for _ in client.completions.create(**body):
            pass


@pytest.mark.parametrize(
    "method,path,status,code",
    [
        ("GET", "/no/such/route", 404, "not_found"),
        ("POST", "/v1/embeddings", 404, "not_found"),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
        ("DELETE", "/v1/models", 405, "method_not_allowed"),
        ("PUT", "/generate", 405, "method_not_allowed"),
    ],
)
def test_unknown_routes_and_methods_are_openai_errors(server, method, path, status, code):
    def count() -> float:
        try:
            return server.metric(f'kvrelay_request_errors_total{{status="{status}"}}')
        except KeyError:
            return 0.0

    before = count()
    r = httpx.request(method, server.url + path, timeout=10)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == code and path in err["message"] and "detail" not in r.json()
    assert count() == before + 1


def test_model_by_id(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    card = client.models.retrieve("smollm2")
    assert card.id == "smollm2" and card.object == "model"
    listed = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    assert listed == httpx.get(server.url + "/v1/models/smollm2", timeout=10).json()
    assert listed["root"] == "smollm2" and "parent" in listed  # vLLM's bench client reads root
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"
