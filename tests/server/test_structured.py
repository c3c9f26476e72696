"""Structured outputs on the embedded SmolLM2 behind a real server, through the official `openai`
client: response_format json_object / json_schema, tool_choice "required" and a named function
(enforced by llguidance grammars), and the 400s of schemas llguidance cannot honour. The
requests run at once (one batch, constrained rows beside free ones); the free ones must give
what they give alone."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "smollm2"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _valid(instance, schema: dict) -> bool:
    try:
        import jsonschema_rs
    except ImportError:  # the hand check below still runs
        return True
    return jsonschema_rs.validator_for(schema).is_valid(instance)


def _person_ok(obj) -> None:
    assert _valid(obj, PERSON), obj
    assert set(obj) == {"name", "age", "colour"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 16
    assert isinstance(obj["age"], int) and obj["colour"] in ("red", "green", "blue")


def _ask(client, content: str, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        **{"max_tokens": 64, **kw},
    )


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int
    colour: Literal["red", "green", "blue"]


FREE = [("Name three colours.", 8), ("Count to five.", 8)]  # (question, max_tokens), greedy
ONE = {"parallel_tool_calls": False, "max_tokens": 40}  # one call: this small model repeats it


@pytest.fixture(scope="module")
def answers(client) -> dict:
    """Every request of this module at once, so that the server batches them (constrained rows
    beside free ones, a share of the CPU time); the free requests also run alone before."""
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    named = {"type": "function", "function": {"name": "add"}}
    jobs = {
        "json_object": lambda: _ask(
            client, "Describe a cat.", response_format={"type": "json_object"}
        ),
        # The official client's parse(): a strict json_schema made from a pydantic model.
        "parse": lambda: client.beta.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Invent a person."}],
            response_format=Person,
            temperature=0,
            max_tokens=48,
        ),
        "completion": lambda: client.completions.create(
            model=MODEL,
            prompt="A person as JSON:",
            max_tokens=48,
            temperature=0,
            extra_body={"response_format": rf},
        ),
        "required": lambda: _ask(
            client, "What is the weather in Paris?", tools=TOOLS, tool_choice="required", **ONE
        ),
        "named": lambda: _ask(client, "What is 2 plus 3?", tools=TOOLS, tool_choice=named, **ONE),
        "none": lambda: _ask(
            client, "What is the weather in Paris?", tools=TOOLS, tool_choice="none", max_tokens=4
        ),
    }
    for i, (q, n) in enumerate(FREE):
        jobs[f"free{i}"] = lambda q=q, n=n: _ask(client, q, max_tokens=n)
    alone = [_ask(client, q, max_tokens=n).choices[0].message.content for q, n in FREE]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        out = {name: f.result() for name, f in futures.items()}
    return out | {"alone": alone}


def test_json_object_returns_json(answers) -> None:
    choice = answers["json_object"].choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_json_schema_strict_output_validates(answers) -> None:
    r = answers["parse"]
    assert r.choices[0].finish_reason == "stop"
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.age, int)
    _person_ok(json.loads(r.choices[0].message.content))
    c = answers["completion"].choices[0]  # the completions route takes response_format too
    assert c.finish_reason == "stop"
    _person_ok(json.loads(c.text))


def _calls(r) -> list[tuple[str, dict]]:
    return [
        (c.function.name, json.loads(c.function.arguments))
        for c in r.choices[0].message.tool_calls or []
    ]


def _schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_tool_choice_required_gives_a_valid_call(answers) -> None:
    r = answers["required"]
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    [(name, args)] = _calls(r)
    assert _valid(args, _schema_of(name)), (name, args)


def test_named_tool_choice_calls_that_function(answers) -> None:
    r = answers["named"]
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    [(name, args)] = _calls(r)
    assert name == "add" and _valid(args, _schema_of("add")), args
    assert isinstance(args["a"], int) and isinstance(args["b"], int)


def test_tool_choice_none_calls_no_tool(answers) -> None:
    r = answers["none"]
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"


def test_constrained_requests_leave_free_ones_unchanged(answers) -> None:
    """Free greedy requests give the same text alone and batched with constrained ones."""
    together = [answers[f"free{i}"].choices[0].message.content for i in range(len(FREE))]
    assert together == answers["alone"]


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "if": {"required": ["a"]}, "then": {}}}}},
            "response_format",
            "if",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "string", "format": "no-such-format"}}}},
            "response_format",
            "no-such-format",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format",
            "json_schema",
        ),
        (
            {"response_format": {"type": "grammar"}},
            "response_format.type",
            "json_schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}],
             "tool_choice": "required"},
            "tools[0].function.parameters",
            "missing",
        ),
    ],
    ids=["unimplemented-keyword", "unknown-format", "no-schema", "unknown-type", "tool-schema"],
)  # fmt: skip
def test_unsupported_schema_is_a_400(server, body: dict, param: str, words: str) -> None:
    msg = [{"role": "user", "content": "hi"}]
    r = _post(server, {"model": MODEL, "messages": msg, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
