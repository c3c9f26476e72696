"""The agentic sessions `kvrelay repro` replays: seeded coding tasks, tools in every request, and
tool results simulated from the call's arguments.

A session is a system prompt that lists the tools (models whose chat template ignores `tools`,
like SmolLM2, still see them), a task, then one assistant turn per request. Every turn but the
last ends in tool calls: the model's own when they are valid against the tool schemas, else a
scripted call, so every session has the same shape whatever the model does. Each result is a
pure function of (tool name, arguments) (workloads.tool_result), so the same calls always get
the same results.
"""

from __future__ import annotations

import json
import random

from kvrelay.bench.detectors import Reply, check_call, parse_text_calls, tools_by_name
from kvrelay.bench.workloads import (
    TOOLS,
    WORDS,
    TextCalibration,
    random_text,
    scripted_tool_call,
    tool_result,
)

SCHEMAS = tools_by_name(TOOLS)
TASKS = (
    "Find where {a} {b} is handled in the code and fix the bug in it.",
    "The test tests/test_{a}.py fails with '{a} {b} {c}'. Find out why.",
    "Read src/{a}/{b}.py and explain what it does.",
    "Rename {a} to {b} in src/{c}.py, then run the tests.",
)


def system_prompt() -> str:
    """The tools' signatures and the JSON-style call format, kept short: every turn prefills it."""
    sigs = ", ".join(
        f"{t['function']['name']}({', '.join(t['function']['parameters']['properties'])})"
        for t in TOOLS
    )
    example = {"name": "read_file", "arguments": {"path": "a.py"}}
    call = f"<tool_call>{json.dumps(example)}</tool_call>"
    return f"You are a coding agent. Tools: {sigs}. To call one: {call}"


def initial_messages(
    num_sessions: int, seed: int, task_words: int, system: str | None = None
) -> list[list[dict]]:
    """Each session's opening messages (system + task), deterministic in the seed. system: None
    for system_prompt(), "" for none (the chat template's default)."""
    rng = random.Random(seed)
    system = system_prompt() if system is None else system
    head = [{"role": "system", "content": system}] if system else []
    sessions = []
    for _ in range(num_sessions):
        a, b, c = (rng.choice(WORDS) for _ in range(3))
        task = rng.choice(TASKS).format(a=a, b=b, c=c)
        if task_words:
            task += " Notes: " + random_text(rng, task_words, TextCalibration())
        sessions.append([*head, {"role": "user", "content": task}])
    return sessions


def calls_to_make(reply: Reply, seed: int, session: int, turn: int) -> list[dict]:
    """The calls this turn makes: the model's valid ones (server-parsed or written in the
    content), else a scripted one. Ids are renumbered: servers mint random ones."""
    text_calls, _ = parse_text_calls(reply.content)
    calls = [c for c in [*reply.tool_calls, *text_calls] if not check_call(c, SCHEMAS)]
    if not calls:
        return [scripted_tool_call(seed, session, turn)]
    return [
        {
            "id": f"call_{session}_{turn}_{k}",
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": _args(c)},
        }
        for k, c in enumerate(calls)
    ]


def _args(call: dict) -> str:
    args = call["function"].get("arguments") or "{}"
    return args if isinstance(args, str) else json.dumps(args)


def after_turn(
    reply: Reply, seed: int, session: int, turn: int, tool_result_len: int
) -> list[dict]:
    """The messages a non-final turn appends: the assistant's reply with its calls, then one
    simulated result per call."""
    calls = calls_to_make(reply, seed, session, turn)
    out: list[dict] = [{"role": "assistant", "content": reply.content, "tool_calls": calls}]
    for c in calls:
        fn = c["function"]
        result = tool_result(fn["name"], fn["arguments"], tool_result_len, TextCalibration())
        out.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    return out
