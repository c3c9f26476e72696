"""The tiny DeepSeek-V4 agent (shared/models/dsv4-tiny-agent, saved by transformers) served by a
real `kvrelay serve` process and driven through the official `openai` client: each question
brings a DSML tool call parsed into `tool_calls`, and after the tool result the answer equals
transformers' own greedy output (float32, full forward) on the same prompt, which is rendered
here with the model's chat format (kvrelay's DeepSeek-V4 encoder, the one its training text was
rendered with) and its tokenizer.

The answers copy a city or number from beyond the 64-token sliding window, so they exercise the
compressed-attention paths (the model often copies wrongly; transformers is the judge). The
oracle is transformers' cached generation, which equals its full forward here: index_topk 4096
keeps every compressed entry, so no top-k selection (whose ties make it length-dependent) occurs.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from conftest import ServerProcess
from dsv4_hf import hf_generate, load_hf

from kvrelay.server.tools.dsv4_chat import encode_messages

# Beside the repository, like the rest of shared/ (a CI checkout may not have it).
AGENT = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "dsv4-tiny-agent"
pytestmark = pytest.mark.skipif(
    not (AGENT / "config.json").is_file(),
    reason=f"the tiny DeepSeek-V4 agent is not at {AGENT} (a checkout without ../shared)",
)
pytestmark = [pytestmark, pytest.mark.usefixtures("one_torch_thread")]  # transformers' tiny ops

MODEL = "dsv4-tiny-agent"
ANSWER_TOKENS = 48
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TOOLS = [  # the three tools it was trained with (make_agent.py)
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
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
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Define a word.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}},
                "required": ["word"],
            },
        },
    },
]
CASES = [
    ("What is the weather in Lima?", "get_weather", {"city": "Lima"}, "sunny, 21 C"),
    ("What does comet mean?", "lookup", {"word": "comet"}, "an icy body that orbits the sun"),
    ("Add 7 and 90.", "add", {"a": 7, "b": 90}, "97"),
]


@pytest.fixture(scope="module")
def client():
    # One engine thread: this model's ops are tiny, and a second thread only contends with the
    # test process (here computing transformers' answers) for the CPU.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVRELAY_CPU_THREADS", "1")
        s = ServerProcess(
            "--model", str(AGENT), "--device", "cpu", "--dtype", "float32",
            "--max-total-tokens", "8192",
        )  # fmt: skip
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    s.close()


@pytest.fixture(scope="module")
def oracle():
    """(transformers' model in float32, the agent's tokenizer)."""
    from transformers import AutoTokenizer

    return load_hf(AGENT), AutoTokenizer.from_pretrained(str(AGENT))


def _prompt_ids(tok, messages: list[dict]) -> list[int]:
    return tok(encode_messages(messages, TOOLS, thinking=False), add_special_tokens=False).input_ids


def _conversation(client: openai.OpenAI, question: str, result: str) -> dict:
    """Ask; if the model calls tools, send `result` as the first call's result and get the
    answer. Returns both responses and the messages of the second request."""
    messages = [SYSTEM, {"role": "user", "content": question}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=160
    )
    out = {"first": first, "first_messages": list(messages), "answer": None}
    calls = first.choices[0].message.tool_calls
    if not calls:
        return out
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": result},
    ]
    out["answer"] = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=ANSWER_TOKENS
    )
    out["answer_messages"] = messages
    return out


@pytest.fixture(scope="module")
def conversations(client) -> dict[str, dict]:
    """The three conversations at once (the server batches them: a third of the CPU time)."""
    with ThreadPoolExecutor(len(CASES)) as pool:
        futures = {q: pool.submit(_conversation, client, q, res) for q, _, _, res in CASES}
        return {q: f.result() for q, f in futures.items()}


@pytest.mark.parametrize(("question", "tool", "args", "result"), CASES)
def test_tool_call_is_parsed(conversations, oracle, question, tool, args, result) -> None:
    r = conversations[question]["first"]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [(tool, args)]
    assert not choice.message.content
    _, tok = oracle
    assert r.usage.prompt_tokens == len(_prompt_ids(tok, conversations[question]["first_messages"]))


@pytest.mark.parametrize(("question", "tool", "args", "result"), CASES)
def test_answer_equals_transformers(conversations, oracle, question, tool, args, result) -> None:
    conv = conversations[question]
    assert conv["answer"] is not None, "no tool call to answer"
    hf, tok = oracle
    prompt = _prompt_ids(tok, conv["answer_messages"])
    assert conv["answer"].usage.prompt_tokens == len(prompt)  # the server rendered the same
    # Cached generation is transformers' full-forward greedy while the indexer drops nothing.
    ratio = hf.config.compress_rates["compressed_sparse_attention"]
    assert (len(prompt) + ANSWER_TOKENS) // ratio <= hf.config.index_topk
    want = hf_generate(hf, prompt, ANSWER_TOKENS, eos=tok.eos_token_id)
    assert want[-1] == tok.eos_token_id  # transformers finished its answer within the budget
    answer = conv["answer"].choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert answer.message.content == tok.decode(want[:-1], skip_special_tokens=True)
    assert answer.message.content  # a real answer, not an empty one


def test_forced_tool_calls_are_dsml(client) -> None:
    """tool_choice named / "required": a grammar writes the DSML call, which the DSML parser
    turns into tool_calls with arguments valid for the tool's schema (batched, both at once)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    jobs = [("What is the weather in Lima?", named), ("Add 7 and 90.", "required")]

    def ask(question, choice):
        messages = [SYSTEM, {"role": "user", "content": question}]
        return client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, temperature=0,
            max_tokens=160, parallel_tool_calls=False,
        )  # fmt: skip

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: ask(*job), jobs))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for r, (_, choice) in zip(answers, jobs, strict=True):
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        [call] = c.message.tool_calls
        args = json.loads(call.function.arguments)
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        schema = schemas[call.function.name]
        assert set(args) == set(schema["required"])
        for key, prop in schema["properties"].items():
            assert isinstance(args[key], {"string": str, "integer": int}[prop["type"]])
