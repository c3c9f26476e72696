"""Every failed request is explained: `kvrelay bench` and `kvrelay repro` keep, per level, a
histogram of failure causes (HTTP status, stream_error, timeout, exception:<type>, ...) and the
first failures word for word, in the JSON and in the printed summary.

Servers that fail in known ways, all over real HTTP: a small FastAPI app in this process that
answers each request with the next failure of a fixed cycle (429 with Retry-After, 502, an SSE
error event, a stream without [DONE], a stall, a dropped connection, ...); a real `kvrelay serve`
with a sticky forward error; a real router in front of servers that are not there."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading
import time

import httpx
import pytest
import uvicorn
from conftest import ServerProcess, free_port
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvrelay.bench.cli import add_bench_parser
from kvrelay.bench.metrics import error_kind
from kvrelay.bench.repro import add_repro_parser

TIMEOUT_S = 1.0  # the clients' request timeout: a stall past it is a timeout


def cli(add_parser, name: str, args: list[str]) -> int:
    """`kvrelay NAME ARGS` in this process, through the parser the CLI uses."""
    p = argparse.ArgumentParser(prog="kvrelay")
    add_parser(p.add_subparsers(dest="command", required=True))
    a = p.parse_args([name, *args])
    return a.func(a)


def error(status: int, message: str, code: str, **headers) -> JSONResponse:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


TOKEN = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 2}}
LAST = {"choices": [{"index": 0, "text": "y", "finish_reason": "length"}]}


async def stream_ok():
    yield sse(TOKEN)
    yield sse(LAST)
    yield sse(USAGE)
    yield sse("[DONE]")


async def stream_error_event():
    yield sse(TOKEN)
    yield sse({"error": {"message": "decode server went away", "code": "stream_broken"}})
    yield sse("[DONE]")


async def stream_no_done():
    yield sse(TOKEN)


async def stream_stall():
    yield sse(TOKEN)
    await asyncio.sleep(30)  # the client gives up first; its disconnect cancels this


async def stream_drop():
    yield sse(TOKEN)
    raise RuntimeError("connection dropped on purpose (test)")  # uvicorn cuts the response


def streamed(events):
    return lambda: StreamingResponse(events(), media_type="text/event-stream")


RETRY_1 = {"Retry-After": "1"}
# What the n-th streamed completion gets, and the cause the bench must name for it.
BENCH_CYCLE = [
    ("ok", None),
    ("429", lambda: error(429, "at most 2 requests in flight", "overloaded", **RETRY_1)),
    ("502", lambda: error(502, "decode server 127.0.0.1:9 is unreachable", "decode_unreachable")),
    ("stream_error", streamed(stream_error_event)),
    ("no_done", streamed(stream_no_done)),
    ("timeout", streamed(stream_stall)),
    ("exception:RemoteProtocolError", streamed(stream_drop)),
]


def chat_reply() -> dict:
    entry = {"token": "ok", "logprob": -0.1, "top_logprobs": [{"token": "ok", "logprob": -0.1}]}
    return {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "logprobs": {"content": [entry]},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1},
    }


async def chat_stall() -> dict:
    await asyncio.sleep(TIMEOUT_S + 0.5)  # past the client's read timeout
    return chat_reply()


# After the reference's requests, what the n-th chat completion gets, and the cause repro names.
REPRO_CYCLE = [
    ("ok", None),
    ("429", lambda: error(429, "router at its limit", "overloaded", **{"Retry-After": "2"})),
    ("503", lambda: error(503, "no decode server is ready", "decode_unavailable")),
    ("500", lambda: PlainTextResponse("Internal Server Error", status_code=500)),
    ("bad_response", lambda: PlainTextResponse("<html>not json</html>")),
    ("exception:ReadTimeout", None),  # a reply that comes too late
]


class FailingServer:
    """The fake OpenAI server, on a real port (uvicorn in a thread). Non-streamed completions
    (the bench's calibration probes) always succeed; streamed ones follow BENCH_CYCLE; chat
    completions succeed `chat_ok_first` times (the repro reference), then follow REPRO_CYCLE."""

    def __init__(self, chat_ok_first: int = 0) -> None:
        self.streamed = itertools.count()
        self.chats = itertools.count()
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            if not body.get("stream"):
                words = len(str(body.get("prompt", "")).split())
                return {
                    "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": words + 1, "completion_tokens": 1},
                }
            _, make = BENCH_CYCLE[next(self.streamed) % len(BENCH_CYCLE)]
            if make is None:
                return StreamingResponse(stream_ok(), media_type="text/event-stream")
            return make()

        @app.post("/v1/chat/completions")
        async def chat():
            n = next(self.chats) - chat_ok_first
            if n < 0:
                return chat_reply()
            name, make = REPRO_CYCLE[n % len(REPRO_CYCLE)]
            if name == "exception:ReadTimeout":
                return await chat_stall()
            return chat_reply() if make is None else make()

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "the fake server did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def failing_server():
    s = FailingServer(chat_ok_first=4)
    yield s
    s.close()


def test_bench_names_the_cause_of_every_failure(failing_server, tmp_path, capsys):
    n = 2 * len(BENCH_CYCLE)  # each behaviour twice
    rc = cli(
        add_bench_parser,
        "bench",
        f"--base-url {failing_server.url} --input-len 16 --output-len 2 --concurrency 3 "
        f"--num-prompts {n} --num-warmups 0 --request-timeout {TIMEOUT_S} --metrics-interval 0 "
        f"--result-dir {tmp_path} --result-filename run.json --no-plots --disable-progress "
        "--ledger off".split(),
    )
    assert rc == 1
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "run.json").read_text())
    (lv,) = result["levels"]
    expect = {name: 2 for name, _ in BENCH_CYCLE if name != "ok"}
    assert (lv["completed"], lv["failed"]) == (2, n - 2)
    assert lv["failure_causes"] == expect
    assert result["totals"]["failure_causes"] == expect
    # The first failures word for word (in order of sending), each under its cause.
    examples = lv["error_examples"]
    assert len(examples) == 5
    assert [e["start_s"] for e in examples] == sorted(e["start_s"] for e in examples)
    by_cause = {e["cause"]: e["error"] for e in examples}
    assert set(by_cause) <= set(expect)
    messages = {
        "429": "HTTP 429 overloaded (Retry-After 1): at most 2 requests in flight",
        "502": "HTTP 502 decode_unreachable: decode server 127.0.0.1:9 is unreachable",
        "stream_error": "stream error stream_broken: decode server went away",
        "no_done": "stream ended without [DONE]",
        "timeout": f"timeout after {TIMEOUT_S:g}s",
    }
    for cause, text in by_cause.items():
        if cause in messages:
            assert text == messages[cause], (cause, text)
        else:
            assert text.startswith("RemoteProtocolError: "), text
    # The summary prints the histogram, the first failures, and the kinds they did not show.
    assert f"c=3: {n - 2} failed, by cause: " in out
    for cause in expect:
        assert f"{cause} 2" in out
    for e in examples:
        assert f"[{e['cause']}] {e['error']}" in out
    shown = set(by_cause)
    for cause in set(expect) - shown:
        if cause in messages:
            assert f"and 2 like: {messages[cause]}" in out, out


def test_repro_names_the_cause_of_every_failure(failing_server, tmp_path, capsys):
    out_json = tmp_path / "repro.json"
    n = 4
    rc = cli(
        add_repro_parser,
        "repro",
        f"--base-url {failing_server.url} --concurrency {n} --num-sessions 4 --turns 1 "
        f"--request-timeout {TIMEOUT_S} --ledger off --output-json {out_json}".split(),
    )
    # The 4 reference requests succeed; the level's 4 meet the first 4 entries of the cycle.
    assert rc == 2
    result = json.loads(out_json.read_text())
    assert result["reference"]["failed_requests"] == 0
    assert (
        result["reference"]["failure_causes"] == {} and result["reference"]["error_examples"] == []
    )
    (lv,) = result["levels"]
    assert lv["failed_requests"] == 3 and lv["compared"] == 1
    assert lv["failure_causes"] == {"429": 1, "503": 1, "500": 1}
    errors = {e["cause"]: e["error"] for e in lv["error_examples"]}
    assert errors == {
        "429": "HTTP 429 overloaded (Retry-After 2): router at its limit",
        "503": "HTTP 503 decode_unavailable: no decode server is ready",
        "500": "HTTP 500: Internal Server Error",
    }
    assert result["verdict"].startswith("no corruption seen, but 3 requests failed (")
    printed = capsys.readouterr().out
    assert f"concurrency {n}: 3 failed requests, by cause: " in printed
    for e in lv["error_examples"]:
        assert f"[{e['cause']}] session {e['session']} turn {e['turn']}: {e['error']}" in printed


def test_repro_names_bad_replies_and_timeouts(tmp_path, capsys):
    # No reference requests before the cycle: sessions 0..5 of the reference meet it in order
    # (concurrency 1), so the reference's own failures are named too.
    s = FailingServer(chat_ok_first=0)
    try:
        out_json = tmp_path / "repro.json"
        rc = cli(
            add_repro_parser,
            "repro",
            f"--base-url {s.url} --concurrency 1 --num-sessions {len(REPRO_CYCLE)} --turns 1 "
            f"--request-timeout {TIMEOUT_S} --ledger off --output-json {out_json}".split(),
        )
    finally:
        s.close()
    assert rc == 2
    ref = json.loads(out_json.read_text())["reference"]
    assert ref["failed_requests"] == len(REPRO_CYCLE) - 1
    assert ref["failure_causes"] == {name: 1 for name, _ in REPRO_CYCLE if name != "ok"}
    errors = {e["cause"]: e["error"] for e in ref["error_examples"]}
    assert errors["bad_response"].startswith("bad response (JSONDecodeError): <html>not json")
    assert errors["exception:ReadTimeout"].startswith("ReadTimeout")
    printed = capsys.readouterr().out
    assert "reference: 5 failed requests, by cause: " in printed
    assert "[exception:ReadTimeout] session 5 turn 0: ReadTimeout" in printed


# --- real kvrelay processes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sticky_server():
    """From its third batch step on, every forward fails (a sticky CUDA error): the bench's two
    calibration probes take the first two, every request after them fails mid-stream."""
    s = ServerProcess(
        *"--model smollm2 --max-total-tokens 4096 --max-num-batched-tokens 512".split(),
        *"--test-fault-sticky-error 3".split(),
    )
    yield s
    s.close()


def test_bench_names_a_real_servers_forward_error(sticky_server, tmp_path, capsys):
    rc = cli(
        add_bench_parser,
        "bench",
        f"--base-url {sticky_server.url} --input-len 16 --output-len 2 --concurrency 2 "
        f"--num-prompts 4 --num-warmups 0 --result-dir {tmp_path} --result-filename run.json "
        "--no-plots --disable-progress --ledger off".split(),
    )
    assert rc == 1, sticky_server.log()
    (lv,) = json.loads((tmp_path / "run.json").read_text())["levels"]
    assert (lv["failed"], lv["failure_causes"]) == (4, {"stream_error": 4}), lv["errors"]
    assert len(lv["error_examples"]) == 4
    for e in lv["error_examples"]:
        assert e["cause"] == "stream_error"
        assert "illegal memory access" in e["error"] and e["error"].startswith("stream error")
    out = capsys.readouterr().out
    assert "c=2: 4 failed, by cause: stream_error 4" in out
    assert "[stream_error] stream error" in out and "illegal memory access" in out


def test_repro_names_what_a_real_router_answers(server, tmp_path, capsys):
    """The reference on a real server; the level through a real router whose servers are not
    there: every request fails, and the report names the router's own status, code and message."""
    from kvrelay.config import RouterConfig
    from kvrelay.router.app import create_router_app

    port = free_port()
    nowhere = ("http://127.0.0.1:9",)  # the discard port: nothing listens
    cfg = RouterConfig(prefill=nowhere, decode=nowhere, connect_timeout_s=1.0, pd_secret="s")
    router = uvicorn.Server(
        uvicorn.Config(create_router_app(cfg), host="127.0.0.1", port=port, log_level="critical")
    )
    thread = threading.Thread(target=router.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 20
        while not router.started:
            assert time.time() < deadline, "router did not start"
            time.sleep(0.02)
        # What the router answers to such a request, asked directly.
        direct = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        out_json = tmp_path / "repro.json"
        rc = cli(
            add_repro_parser,
            "repro",
            f"--base-url {url} --reference-url {server.url} --model smollm2 --concurrency 2 "
            "--reference-concurrency 2 --num-sessions 2 --turns 1 --max-tokens 4 --task-words 0 --system-prompt=Agent. "
            f"--no-tools-field --request-timeout 30 --ledger off --output-json {out_json}".split(),
        )
    finally:
        router.should_exit = True
        thread.join(timeout=10)
    assert rc == 2
    result = json.loads(out_json.read_text())
    assert result["reference"]["failed_requests"] == 0
    (lv,) = result["levels"]
    status = str(direct.status_code)
    code, message = direct.json()["error"]["code"], direct.json()["error"]["message"]
    assert direct.status_code >= 500 and code
    assert lv["failed_requests"] == 2 and lv["failure_causes"] == {status: 2}
    for e in lv["error_examples"]:
        assert error_kind(e["error"]) == error_kind(f"HTTP {status} {code}: {message}")
    printed = capsys.readouterr().out
    assert f"concurrency 2: 2 failed requests, by cause: {status} 2" in printed
    assert f"[{status}] session 0 turn 0: HTTP {status} {code}" in printed
