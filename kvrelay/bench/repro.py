"""`kvrelay repro`: replay agentic tool-call sessions at several concurrency levels and count the
sessions whose output was damaged.

1. Reference pass: every session runs greedily (temperature 0, top-2 logprobs) at
   `--reference-concurrency` (default 1) against `--reference-url` (default: the server under
   test). A session feeds its own replies back: assistant message, tool calls, simulated results.
2. One pass per `--concurrency` level against the server under test, each sending exactly the
   reference's requests (teacher forcing): turn k's history is the REFERENCE's turns 1..k-1,
   never this pass's own replies. A divergence in turn 1 therefore stays in turn 1 instead of
   changing every later prompt, every turn is a clean greedy comparison of one request, and a
   session's turns are independent trials. Sessions still run their turns in order, so the
   traffic keeps its agentic shape (context growing turn by turn, `c` sessions in flight).
3. Each turn is compared with the reference's reply to the same request token by token
   (verify.compare on the logprobs token strings), and the detectors run on both replies.

A turn is corrupt when it diverges from the reference (unless the divergence is a near-tie: the
reference's top-2 logprob gap there is below `--near-tie` and the test's token is its runner-up,
which is numerics, not damage), or when a detector finds, in the part of the turn that matches the
reference token for token, something the reference reply does not have. Findings after a near-tie
are reported apart and not counted (repro_judge.py). A session is corrupt when any turn is. The
reference's own findings are reported as the baseline. Per level: corrupt sessions / compared sessions with
a 95% Wilson interval. Exit 0: no corruption; 1: corruption; 2: could not run, or requests
failed and nothing was corrupt.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass

import httpx

from kvrelay.bench import repro_sessions as sessions
from kvrelay.bench.detectors import DETECTORS, Reply, detect
from kvrelay.bench.loadgen import BenchError, http_error, resolve_model
from kvrelay.bench.metrics import describe_causes, failure_report, merge_causes
from kvrelay.bench.repro_deterministic import confirm_deterministic
from kvrelay.bench.repro_judge import Turn, TurnVerdict, judge_level
from kvrelay.bench.repro_report import highlight, print_report
from kvrelay.bench.verify import DEFAULT_NEAR_TIE, Output
from kvrelay.bench.workloads import CHAT, TOOLS
from kvrelay.config import api_key_headers

SCHEMA = "kvrelay-repro/1"


@dataclass
class ReproConfig:
    url: str
    reference_url: str | None = None  # None: the server under test
    model: str | None = None
    concurrency: tuple[int, ...] = (1, 16, 64)
    reference_concurrency: int = 1
    num_sessions: int = 64
    turns: int = 3
    max_tokens: int = 64
    seed: int = 0
    task_words: int = 16  # random words appended to each task
    system_prompt: str | None = None  # None: the tools and call format; "": no system message
    tool_result_len: int = 32  # words of each simulated tool result
    # send `tools` with each request; off, the sessions still list them in their system prompt
    # (and the server adds no tool prompt of its own: shorter prefills on a CPU)
    send_tools: bool = True
    ignore_eos: bool = False
    near_tie: float = DEFAULT_NEAR_TIE
    num_examples: int = 5
    request_timeout_s: float = 600.0
    # the servers run --deterministic (confirmed first): every divergence is a defect
    deterministic_check: bool = False

    def check(self) -> None:
        for name in ("num_sessions", "turns", "max_tokens", "reference_concurrency"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be at least 1")
        if not self.concurrency or min(self.concurrency) < 1:
            raise BenchError("--concurrency needs levels of at least 1")
        if self.deterministic_check and self.near_tie != 0:
            raise BenchError("--deterministic-check allows no near-ties (--near-tie 0)")


# --- talking to the server --------------------------------------------------------------------------


def request_body(messages: list[dict], cfg: ReproConfig) -> dict:
    body = {
        "messages": [dict(m) for m in messages],
        "max_tokens": cfg.max_tokens,
        "temperature": 0.0,
        "ignore_eos": cfg.ignore_eos,
        "logprobs": True,
        "top_logprobs": 2,
    }
    if cfg.send_tools:
        body |= {"tools": TOOLS, "tool_choice": "auto"}
    return body


def parse_choice(choice: dict) -> tuple[Output, Reply]:
    msg = choice.get("message") or {}
    entries = (choice.get("logprobs") or {}).get("content") or []
    reply = Reply(
        content=msg.get("content") or "",
        reasoning=msg.get("reasoning_content") or "",
        tool_calls=list(msg.get("tool_calls") or []),
        tokens=[e["token"] for e in entries],
        finish_reason=choice.get("finish_reason"),
    )
    # Compared text: everything the reply carries except tool call ids (servers mint random ones).
    calls = "".join(
        f"\n{c['function'].get('name')}{c['function'].get('arguments')}" for c in reply.tool_calls
    )
    output = Output(
        text=reply.reasoning + reply.content + calls,
        tokens=reply.tokens,
        token_logprobs=[e.get("logprob") for e in entries],
        top_logprobs=[
            {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []} for e in entries
        ],
    )
    return output, reply


async def chat(
    client: httpx.AsyncClient, url: str, model: str, body: dict, timeout: float
) -> tuple[Output, Reply, str | None]:
    """One turn: its output and reply, and on failure its cause (the HTTP status, "bad_response"
    or "exception:<type>"; the message is the output's error)."""
    try:
        r = await client.post(url + CHAT, json={"model": model, **body}, timeout=timeout)
    except httpx.HTTPError as e:
        return Output(error=f"{type(e).__name__}: {e}"), Reply(), f"exception:{type(e).__name__}"
    if r.status_code != 200:
        return (
            Output(error=http_error(r.status_code, r.content, r.headers)),
            Reply(),
            str(r.status_code),
        )
    try:
        return (*parse_choice(r.json()["choices"][0]), None)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        err = f"bad response ({type(e).__name__}): {r.text[:200]}"
        return Output(error=err), Reply(), "bad_response"


class Runner:
    """One server, one model, one HTTP client: runs sessions at a concurrency."""

    def __init__(self, client: httpx.AsyncClient, url: str, model: str, cfg: ReproConfig) -> None:
        self.client, self.url, self.model, self.cfg = client, url, model, cfg

    async def turn(self, body: dict) -> Turn:
        output, reply, cause = await chat(
            self.client, self.url, self.model, body, self.cfg.request_timeout_s
        )
        findings = [] if output.error else detect(reply, sessions.SCHEMAS, self.cfg.ignore_eos)
        return Turn(body, output, reply, findings, cause)

    async def free_session(self, index: int, messages: list[dict]) -> list[Turn]:
        """The reference: the session's own replies (and their tool calls) become its history."""
        turns: list[Turn] = []
        for k in range(self.cfg.turns):
            t = await self.turn(request_body(messages, self.cfg))
            turns.append(t)
            if t.output.error:
                break
            if k + 1 < self.cfg.turns:
                messages = messages + sessions.after_turn(
                    t.reply, self.cfg.seed, index, k, self.cfg.tool_result_len
                )
        return turns

    async def forced_session(self, reference: list[Turn]) -> list[Turn]:
        """Teacher forcing: exactly the reference's requests, one after another."""
        turns = []
        for ref in reference:
            if ref.output.error:
                break
            turns.append(await self.turn(ref.body))
        return turns

    async def run(self, jobs: list, concurrency: int) -> tuple[list[list[Turn]], float]:
        """Awaitables, at most `concurrency` in flight; results in job order, and seconds."""
        sem = asyncio.Semaphore(concurrency)

        async def one(job) -> list[Turn]:
            async with sem:
                return await job

        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(j) for j in jobs))
        return list(out), round(time.perf_counter() - t0, 3)


# --- judging ----------------------------------------------------------------------------------------


def example(concurrency: int, v: TurnVerdict, ref: Turn, test: Turn) -> dict:
    c = v.comparison
    pos = c.first_divergence if c is not None and not c.identical else None
    return {
        "concurrency": concurrency,
        "session": v.session,
        "turn": v.turn,
        "first_divergence": pos,
        "reference_token": c.a_token if pos is not None else None,
        "test_token": c.b_token if pos is not None else None,
        "ref_top2_gap": c.ref_top2_gap if pos is not None else None,
        "findings": [asdict(f) for f in v.new_findings],
        "after_near_tie": [asdict(f) for f in v.after_near_tie],
        "highlight": None if pos is None else highlight(ref.output.tokens, test.output.tokens, pos),
        "reference_text": ref.output.text,
        "test_text": test.output.text,
    }


def worst_examples(cases: list[tuple[int, TurnVerdict, Turn, Turn]], n: int) -> list[dict]:
    """Most detector findings first, then the earliest divergence (the most text damaged)."""

    def badness(case) -> tuple[int, int]:
        v = case[1]
        pos = v.comparison.first_divergence if v.diverged else None
        return (-len(v.new_findings), pos if pos is not None else 1 << 30)

    return [example(*case) for case in sorted(cases, key=badness)[:n]]


# --- the run ----------------------------------------------------------------------------------------


async def run_repro(cfg: ReproConfig, on_pass=None) -> dict:
    """on_pass(label, seconds) after each pass, for progress."""
    cfg.check()
    ref_url = cfg.reference_url or cfg.url
    starts = sessions.initial_messages(
        cfg.num_sessions, cfg.seed, cfg.task_words, cfg.system_prompt
    )
    # No cap on connections (httpx's default is 100): a level of c sessions must put c requests
    # in flight, not queue the rest in the client's pool where they time out unexplained.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        timeout=cfg.request_timeout_s, headers=api_key_headers(), limits=limits
    ) as client:
        checked = []
        if cfg.deterministic_check:
            for url in dict.fromkeys((ref_url, cfg.url)):
                checked += await confirm_deterministic(client, url)
        model = cfg.model or await resolve_model(client, cfg.url)
        ref_model = cfg.model or await resolve_model(client, ref_url)
        ref_runner = Runner(client, ref_url, ref_model, cfg)
        reference, ref_secs = await ref_runner.run(
            [ref_runner.free_session(i, m) for i, m in enumerate(starts)],
            cfg.reference_concurrency,
        )
        if on_pass:
            on_pass(f"reference at concurrency {cfg.reference_concurrency}", ref_secs)
        ref_turns = [t for ts in reference for t in ts]
        if all(t.output.error for t in ref_turns):
            raise BenchError(f"every reference request failed, e.g. {ref_turns[0].output.error}")
        runner = Runner(client, cfg.url, model, cfg)
        levels, cases = [], []
        for c in cfg.concurrency:
            tested, secs = await runner.run([runner.forced_session(r) for r in reference], c)
            level, verdicts = judge_level(c, reference, tested, secs, cfg.near_tie, cfg.ignore_eos)
            levels.append(level)
            cases += [
                (c, v, reference[v.session][v.turn], tested[v.session][v.turn])
                for v in verdicts
                if v.corrupt
            ]
            if on_pass:
                on_pass(f"concurrency {c}", secs)
    ref_findings = Counter(f.detector for t in ref_turns for f in t.findings)
    ref_failures = failure_report(
        [
            (t.cause, t.output.error, {"session": i, "turn": k})
            for i, ts in enumerate(reference)
            for k, t in enumerate(ts)
            if t.output.error
        ]
    )
    failed = sum(1 for t in ref_turns if t.output.error) + sum(
        lv["failed_requests"] for lv in levels
    )
    corrupted = sum(lv["corrupted"] for lv in levels)
    if corrupted and cfg.deterministic_check:
        verdict, code = "corruption found (batch-invariant servers: no divergence is numerics)", 1
    elif corrupted:
        verdict, code = "corruption found", 1
    elif failed:
        causes = merge_causes(
            [ref_failures["failure_causes"], *(lv["failure_causes"] for lv in levels)]
        )
        verdict = f"no corruption seen, but {failed} requests failed ({describe_causes(causes)})"
        code = 2
    else:
        verdict, code = "no corruption", 0
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": asdict(cfg),
        "url": cfg.url,
        "model": model,
        "deterministic_servers": checked,  # confirmed by --deterministic-check
        "reference": {
            "url": ref_url,
            "model": ref_model,
            "concurrency": cfg.reference_concurrency,
            "sessions": len(reference),
            "duration_s": ref_secs,
            "failed_requests": sum(1 for t in ref_turns if t.output.error),
            **ref_failures,  # failure_causes (a histogram) and the first error_examples
            "output_tokens": sum(len(t.output.tokens) for t in ref_turns),
            "tokens_per_session": [sum(len(t.output.tokens) for t in ts) for ts in reference],
            "detectors": {d: ref_findings[d] for d in DETECTORS},
            # A batched reference carries batch-mix numerics (and any concurrency bug) itself.
            "batched": cfg.reference_concurrency > 1,
        },
        "levels": levels,
        "examples": worst_examples(cases, cfg.num_examples),
        "verdict": verdict,
        "exit_code": code,
    }


# --- CLI --------------------------------------------------------------------------------------------


def _levels(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


def add_repro_parser(subparsers) -> argparse.ArgumentParser:
    from kvrelay.bench.cli_shared import HelpFormatter
    from kvrelay.ledger.cli import add_ledger_arg

    d = ReproConfig(url="")
    p = subparsers.add_parser(
        "repro",
        formatter_class=HelpFormatter,
        help="replay agentic tool-call sessions at several concurrency levels and count corruption",
        description="Runs multi-turn tool-call sessions greedily once as a reference (concurrency "
        "1, or on --reference-url), then replays the very same requests at each --concurrency "
        "level (teacher forcing: later turns carry the reference's replies, so one divergence "
        "cannot spread). A turn is corrupt when it diverges from the reference (near-ties "
        "excepted) or when a detector (tool-call parse, argument schema, tag balance, leaked "
        "special tokens, n-gram loops) finds, in the part that matches the reference token for "
        "token, what the reference reply does not have; findings after a near-tie are reported "
        "apart, not counted. Reports "
        "the corrupt-session rate per level with a 95% Wilson interval and the worst examples. "
        "Exit 0: no corruption; 1: corruption; 2: could not run.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server under test")
    p.add_argument(
        "--reference-url", default=None, help="server of the reference run (default: --base-url)"
    )
    p.add_argument("--model", default=None, help="model to request (default: the server's first)")
    p.add_argument(
        "--concurrency",
        type=_levels,
        default=",".join(map(str, d.concurrency)),
        help="levels, sessions in flight, e.g. 1,16,64",
    )
    p.add_argument(
        "--reference-concurrency",
        type=int,
        default=d.reference_concurrency,
        help="sessions in flight during the reference run",
    )
    p.add_argument("--num-sessions", type=int, default=d.num_sessions, help="sessions per level")
    p.add_argument("--turns", type=int, default=d.turns, help="requests per session")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max_tokens of each turn")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the tasks")
    p.add_argument(
        "--task-words", type=int, default=d.task_words, help="random words added to each task"
    )
    p.add_argument(
        "--system-prompt",
        default=None,
        help="system message of every session (default: the tools' signatures and the "
        "<tool_call> format; '': none, so the chat template's default applies)",
    )
    p.add_argument(
        "--tool-result-len",
        type=int,
        default=d.tool_result_len,
        help="words of each simulated tool result",
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens every turn")
    p.add_argument(
        "--no-tools-field",
        action="store_true",
        help="send no `tools` with the requests (the system prompt still lists them; the server "
        "then adds no tool prompt of its own)",
    )
    p.add_argument(
        "--near-tie",
        type=float,
        default=None,
        help="nats: a divergence to the reference's runner-up token with a top-2 gap below this "
        f"is numerics, not corruption (0: count every divergence; default {d.near_tie}, 0 with "
        "--deterministic-check)",
    )
    p.add_argument(
        "--deterministic-check",
        action="store_true",
        help="the servers run --deterministic (confirmed from /server_info first, behind a "
        "router each server): every divergent turn is a defect, no near-tie allowance "
        "(implies --near-tie 0)",
    )
    p.add_argument(
        "--num-examples", type=int, default=d.num_examples, help="worst examples to show"
    )
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s, help="seconds")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the result here")
    add_ledger_arg(p)
    p.set_defaults(func=cmd_repro)
    return p


def cmd_repro(a: argparse.Namespace) -> int:
    from pathlib import Path

    from kvrelay.bench import report

    d_tie = ReproConfig(url="").near_tie
    cfg = ReproConfig(
        url=a.base_url.rstrip("/"),
        reference_url=a.reference_url.rstrip("/") if a.reference_url else None,
        model=a.model,
        concurrency=a.concurrency,
        reference_concurrency=a.reference_concurrency,
        num_sessions=a.num_sessions,
        turns=a.turns,
        max_tokens=a.max_tokens,
        seed=a.seed,
        task_words=a.task_words,
        system_prompt=a.system_prompt,
        tool_result_len=a.tool_result_len,
        ignore_eos=a.ignore_eos,
        send_tools=not a.no_tools_field,
        near_tie=a.near_tie if a.near_tie is not None else 0.0 if a.deterministic_check else d_tie,
        deterministic_check=a.deterministic_check,
        num_examples=a.num_examples,
        request_timeout_s=a.request_timeout,
    )
    started = time.time()

    def progress(label: str, secs: float) -> None:
        sys.stderr.write(f"kvrelay repro: {label} done in {secs:.1f}s\n")

    try:
        result = asyncio.run(run_repro(cfg, progress))
    except BenchError as e:
        sys.stderr.write(f"kvrelay repro: {e}\n")
        return 2
    print_report(result, sys.stdout)
    if a.output_json:
        sys.stdout.write(f"wrote {report.write_json(result, Path(a.output_json))}\n")
    _record(a, cfg, result, started)
    return result["exit_code"]


def _record(a: argparse.Namespace, cfg: ReproConfig, result: dict, started: float) -> None:
    """Into the ledger, under the configuration of the server under test."""
    from kvrelay.ledger.cli import save_run

    levels = ", ".join(
        f"c={lv['concurrency']} {lv['corrupted']}/{lv['compared']}" for lv in result["levels"]
    )
    save_run(
        a,
        "repro",
        result["config"],
        result,
        server_url=cfg.url,
        workload=f"repro {cfg.num_sessions} sessions x {cfg.turns} turns, max_tokens "
        f"{cfg.max_tokens}, reference c={cfg.reference_concurrency}"
        + (f" on {cfg.reference_url}" if cfg.reference_url else ""),
        headline=f"{result['verdict']}: corrupt sessions {levels}",
        started_at=started,
        status="errors" if result["exit_code"] == 2 else "ok",
    )
