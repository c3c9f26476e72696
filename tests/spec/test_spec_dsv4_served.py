"""`kvrelay serve --speculative-algorithm ngram` and `mtp` (its trained MTP block,
tests/data/dsv4-tiny-agent-mtp.safetensors) on the tiny DeepSeek-V4 agent (real weights,
shared/models/dsv4-tiny-agent, float32 on CPU) against the same agent served plainly, through
the official openai client: multi-turn tool-calling conversations (a finished task, then a new question: a DSML tool call
and the answer after the tool result, both repeating the form of the first task's, which n-gram
drafts predict) give the
plain answers at concurrency 1 and 8 while drafts are accepted and rejected (/metrics).

DeepSeek-V4 keeps per-request compressor state where a rejected draft writes rows: its slot
keeps two windows so that nothing reads them (tests/spec/test_dsv4_rejected_close.py checks that
directly). Verify rows run in chunks of other sizes than plain decoding's, and the agent runs
its QAT roundings (FP8 cache rows, FP4 index keys), which turn an fp32 ulp into a rounding step
now and then: logprobs agree within 2e-3 (measured: ~1e-3 on random weights), and a token may
differ only where the plain answer's top two were that close (a near-tie; then the rest of that
answer is not compared)."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from conftest import ServerProcess

sys.path.insert(0, str(Path(__file__).parents[1] / "disagg"))
from pd_stack import PDStack  # noqa: E402

AGENT = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "dsv4-tiny-agent"
pytestmark = pytest.mark.skipif(
    not (AGENT / "config.json").is_file(),
    reason=f"the tiny DeepSeek-V4 agent is not at {AGENT} (a checkout without ../shared)",
)
MODEL = "dsv4-tiny-agent"
LOGPROB_TOL = 2e-3
NEAR_TIE = 2e-2  # top-2 logprob gap under which a token may differ
ARGS = ("--model", str(AGENT), "--device", "cpu", "--dtype", "float32", "--max-total-tokens",
        "16384")  # fmt: skip
MTP_BLOCK = Path(__file__).resolve().parents[1] / "data" / "dsv4-tiny-agent-mtp.safetensors"
SPEC = {
    "ngram": ("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4"),
    # the MTP block trained for the agent (scripts/train_agent_mtp.py)
    # K = 3: the block chained on its own output
    "mtp": ("--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", "3",
            "--speculative-draft-model-path", str(MTP_BLOCK)),
}  # fmt: skip
ACCEPTED = "kvrelay_spec_decode_num_accepted_tokens_total"
DRAFTED = "kvrelay_spec_decode_num_draft_tokens_total"


def _tool(name: str, desc: str, **props: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": v} for k, v in props.items()},
                "required": list(props),
            },
        },
    }


TOOLS = [  # the three tools it was trained with (make_agent.py)
    _tool("get_weather", "Current weather of a city.", city="string"),
    _tool("add", "Add two integers.", a="integer", b="integer"),
    _tool("lookup", "Define a word.", word="string"),
]


def _call(i: int, name: str, args: dict) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}  # fmt: skip


def _done(question: str, name: str, args: dict, result: str, answer: str) -> list[dict]:
    """A finished task of the kind the agent was trained on: question, call, result, answer."""
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [_call(0, name, args)]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": answer},
    ]


SYSTEM = [{"role": "system", "content": "You are a helpful assistant."}]
WEATHER = _done("What is the weather in Lima?", "get_weather", {"city": "Lima"}, "sunny, 21 C",
                "It is sunny and 21 C in Lima.")  # fmt: skip
ADD = _done("Add 7 and 90.", "add", {"a": 7, "b": 90}, "97", "7 plus 90 is 97.")
LOOKUP = _done("What does comet mean?", "lookup", {"word": "comet"},
               "an icy body that orbits the sun", "Comet means an icy body that orbits the sun.")  # fmt: skip
# (history, question, the tool result to answer with): a second task after a first one, whose
# call and answer it repeats in form (n-gram drafts find them), and a few without history.
CONVERSATIONS = [
    (WEATHER, "What is the weather in Oslo?", "windy, 4 C"),
    (ADD, "Add 17 and 25.", "42"),
    (LOOKUP, "What does glacier mean?", "a slow river of ice"),
    (WEATHER, "Add 3 and 4.", "7"),
    (ADD, "What is the weather in Cairo?", "foggy, 30 C"),
    ([], "Repeat after me: Paris lantern Oslo comet", ""),
    (LOOKUP + WEATHER, "How is the weather in Riga today?", "snowy, -3 C"),
    ([], "Count from 4 to 9.", ""),
]


def _ask(c: openai.OpenAI, messages: list[dict]) -> dict:
    r = c.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=48,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    ch = r.choices[0]
    lps = ch.logprobs.content or []
    return {
        "message": ch.message,
        "finish": ch.finish_reason,
        "tokens": [x.token for x in lps],
        "lps": [x.logprob for x in lps],
        "tops": [[t.logprob for t in x.top_logprobs] for x in lps],
    }


def _conversation(url: str, history: list[dict], question: str, result: str) -> list[dict]:
    """The first answer and, after a tool call, the answer to the tool's result."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [*SYSTEM, *history, {"role": "user", "content": question}]
    first = _ask(c, messages)
    calls = first["message"].tool_calls
    if not calls:
        return [first]
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [x.model_dump() for x in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": result},
    ]
    return [first, _ask(c, messages)]


def _all(url: str, which: list[int]) -> list[list[dict]]:
    with ThreadPoolExecutor(len(which)) as ex:
        return list(ex.map(lambda i: _conversation(url, *CONVERSATIONS[i]), which))


def _same_answer(want: dict, got: dict) -> None:
    for i, (a, b) in enumerate(zip(want["tokens"], got["tokens"], strict=False)):
        if a != b:
            top = want["tops"][i]
            assert len(top) == 2 and top[0] - top[1] < NEAR_TIE, (i, a, b, top)
            return  # a near-tie: what follows is another answer
        assert abs(want["lps"][i] - got["lps"][i]) <= LOGPROB_TOL, (
            i,
            want["lps"][i],
            got["lps"][i],
        )
    assert got["tokens"] == want["tokens"] and got["finish"] == want["finish"]
    w, g = want["message"], got["message"]
    assert g.content == w.content
    assert [(t.function.name, t.function.arguments) for t in g.tool_calls or []] == [
        (t.function.name, t.function.arguments) for t in w.tool_calls or []
    ]


@pytest.fixture(scope="module")
def servers():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVRELAY_CPU_THREADS", "1")  # this model's ops are tiny
        procs = {"plain": ServerProcess(*ARGS)}
        procs |= {name: ServerProcess(*ARGS, *args) for name, args in SPEC.items()}
    yield procs
    for p in procs.values():
        p.close()


@pytest.fixture(scope="module")
def plain_answers(servers):
    return _all(servers["plain"].url, list(range(len(CONVERSATIONS))))


@pytest.mark.parametrize("algorithm", list(SPEC))
@pytest.mark.parametrize("which", [[0], list(range(len(CONVERSATIONS)))], ids=["c1", "c8"])
def test_conversations_equal_plain_decoding(servers, plain_answers, algorithm, which) -> None:
    spec = servers[algorithm]
    accepted, drafted = spec.metric(ACCEPTED), spec.metric(DRAFTED)
    got = _all(spec.url, which)
    for i, conv in zip(which, got, strict=True):
        want = plain_answers[i]
        assert len(conv) == len(want), (i, [a["message"] for a in conv])
        for w, g in zip(want, conv, strict=True):
            _same_answer(w, g)
    accepted, drafted = spec.metric(ACCEPTED) - accepted, spec.metric(DRAFTED) - drafted
    assert 0 < accepted <= drafted
    if len(which) > 1:  # and some were rejected
        assert accepted < drafted
    if algorithm == "mtp":  # the trained block predicts the agent well
        assert accepted >= 0.7 * drafted, (accepted, drafted)
    print(f"{algorithm}: {accepted:.0f} of {drafted:.0f} drafts accepted")


@pytest.mark.parametrize("algorithm", list(SPEC))
def test_pd_with_a_speculating_decode_equals_plain_single(plain_answers, algorithm) -> None:
    """Through a router to a prefill and a speculating decode server (with mtp, prefill runs
    the MTP block too: its window rows of the prompt travel with the rest of the cache)."""
    model = ("--model", str(AGENT), "--device", "cpu", "--dtype", "float32")
    prefill = SPEC["mtp"] if algorithm == "mtp" else ()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVRELAY_CPU_THREADS", "1")
        stack = PDStack(prefill_args=prefill, decode_args=SPEC[algorithm], model=model)
    try:
        accepted = stack.decode.metric(ACCEPTED)
        which = list(range(len(CONVERSATIONS)))
        for i, conv in zip(which, _all(stack.router.url, which), strict=True):
            assert len(conv) == len(plain_answers[i])
            for w, g in zip(plain_answers[i], conv, strict=True):
                _same_answer(w, g)
        assert stack.decode.metric(ACCEPTED) > accepted
        stack.wait_idle()
    finally:
        stack.close()
