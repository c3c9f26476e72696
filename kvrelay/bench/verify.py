"""`kvrelay verify`: the same greedy prompts against two OpenAI-compatible endpoints (PD router vs
single server, or one server at concurrency 1 vs itself at 64), compared token by token.

Each prompt runs with temperature 0, `ignore_eos` and `logprobs=2` on /v1/completions. The server
does not return output token ids, so outputs are compared as the `logprobs.tokens` strings plus the
final text: two outputs that decode to the same strings token by token count as identical (a
difference hidden by two ids with the same text would go unseen; with greedy decoding on one model
that is vanishingly rare). At the first divergent position the reference's (A's) top-2 logprob gap
tells a near-tie (numerics picked the other of two almost equal tokens) from a real difference.

A runs to completion before B starts, so A = B = one URL compares a server against itself without
the two runs sharing batches. Exit codes: 0 all identical, 1 any difference, 2 could not run (or a
request failed and nothing differed).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvrelay.bench.loadgen import BenchError, calibrate, resolve_model
from kvrelay.bench.workloads import COMPLETIONS, WorkloadConfig, build_sessions
from kvrelay.config import api_key_headers

SCHEMA = "kvrelay-verify/1"
DEFAULT_NEAR_TIE = 0.1  # nats: a top-2 gap below this is within bf16/fp16 numeric noise


# --- comparison (pure) ------------------------------------------------------------------------------


@dataclass
class Output:
    """One endpoint's greedy completion of one prompt."""

    text: str = ""
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    error: str | None = None

    @classmethod
    def from_choice(cls, choice: dict) -> Output:
        lp = choice.get("logprobs") or {}
        return cls(
            text=choice.get("text") or "",
            tokens=list(lp.get("tokens") or []),
            token_logprobs=list(lp.get("token_logprobs") or []),
            top_logprobs=[t or {} for t in lp.get("top_logprobs") or []],
        )


@dataclass
class Comparison:
    index: int
    identical: bool
    a_tokens: int = 0
    b_tokens: int = 0
    first_divergence: int | None = None  # token position; None when identical (or on error)
    a_token: str | None = None  # the tokens at the first divergence (None: that output ended)
    b_token: str | None = None
    ref_top2_gap: float | None = None  # A's top-1 minus top-2 logprob there
    near_tie: bool | None = None  # ref_top2_gap < the near-tie threshold
    b_token_in_ref_top: bool | None = None  # B's token among A's top-2 there
    max_logprob_delta: float | None = None  # max |lp_A - lp_B| over the common prefix
    num_logprob_deltas: int = 0
    sum_logprob_delta: float = 0.0
    error: str | None = None
    a_text: str | None = None  # kept only for differing prompts, to read the damage
    b_text: str | None = None


def first_divergence(a: list[str], b: list[str]) -> int | None:
    """The first position where the token lists differ (a shorter list differs where it ends)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(top: dict[str, float] | None) -> float | None:
    """Top-1 minus top-2 logprob; None without two alternatives."""
    values = sorted((v for v in (top or {}).values() if v is not None), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else None


def compare(index: int, a: Output, b: Output, near_tie: float = DEFAULT_NEAR_TIE) -> Comparison:
    if a.error or b.error:
        err = "; ".join(f"{n}: {o.error}" for n, o in (("A", a), ("B", b)) if o.error)
        return Comparison(index, identical=False, error=err)
    pos = first_divergence(a.tokens, b.tokens)
    if pos is None and a.text != b.text:
        # Same token strings, different text: only detokenisation can do that; call it position 0
        # of nothing in particular rather than hide it.
        pos = 0
    c = Comparison(index, identical=pos is None, a_tokens=len(a.tokens), b_tokens=len(b.tokens))
    common = len(a.tokens) if pos is None else pos
    deltas = [
        abs(x - y)
        for x, y in zip(a.token_logprobs[:common], b.token_logprobs[:common], strict=False)
        if x is not None and y is not None
    ]
    if deltas:
        c.max_logprob_delta = max(deltas)
        c.num_logprob_deltas, c.sum_logprob_delta = len(deltas), math.fsum(deltas)
    if pos is not None:
        c.first_divergence = pos
        c.a_token = a.tokens[pos] if pos < len(a.tokens) else None
        c.b_token = b.tokens[pos] if pos < len(b.tokens) else None
        top = a.top_logprobs[pos] if pos < len(a.top_logprobs) else None
        c.ref_top2_gap = top2_gap(top)
        if c.ref_top2_gap is not None:
            c.near_tie = c.ref_top2_gap < near_tie
        if top and c.b_token is not None:
            c.b_token_in_ref_top = c.b_token in top
        c.a_text, c.b_text = a.text, b.text
    return c


def bucket_label(pos: int) -> str:
    """Power-of-two buckets: 0, 1, 2-3, 4-7, 8-15, ..."""
    if pos < 2:
        return str(pos)
    lo = 1 << (pos.bit_length() - 1)
    return f"{lo}-{2 * lo - 1}"


def divergence_histogram(positions: list[int]) -> dict[str, int]:
    """Counts of first-divergence positions per power-of-two bucket, in position order."""
    hist: dict[str, int] = {}
    for p in sorted(positions):
        label = bucket_label(p)
        hist[label] = hist.get(label, 0) + 1
    return hist


def summarize(comparisons: list[Comparison]) -> dict:
    done = [c for c in comparisons if c.error is None]
    diff = [c for c in done if not c.identical]
    n_deltas = sum(c.num_logprob_deltas for c in done)
    maxes = [c.max_logprob_delta for c in done if c.max_logprob_delta is not None]
    errors = len(comparisons) - len(done)
    if diff:
        verdict = "near-ties only" if all(c.near_tie for c in diff) else "different"
    elif errors:
        verdict = "incomplete"
    else:
        verdict = "identical"
    return {
        "num_prompts": len(comparisons),
        "identical": len(done) - len(diff),
        "different": len(diff),
        "near_tie": sum(1 for c in diff if c.near_tie),
        "errors": errors,
        "divergence_histogram": divergence_histogram(
            [c.first_divergence for c in diff if c.first_divergence is not None]
        ),
        "max_logprob_delta": max(maxes) if maxes else None,
        "mean_logprob_delta": (math.fsum(c.sum_logprob_delta for c in done) / n_deltas)
        if n_deltas
        else None,
        "verdict": verdict,
    }


def exit_code(summary: dict) -> int:
    if summary["different"]:
        return 1
    return 2 if summary["errors"] else 0


# --- running ----------------------------------------------------------------------------------------


@dataclass
class VerifyConfig:
    url_a: str
    url_b: str
    model: str | None = None
    num_prompts: int = 16
    input_len: int = 256
    output_len: int = 64
    seed: int = 0
    concurrency_a: int = 1
    concurrency_b: int = 1
    near_tie: float = DEFAULT_NEAR_TIE
    request_timeout_s: float = 600.0


async def _complete(client: httpx.AsyncClient, url: str, body: dict, timeout: float) -> Output:
    try:
        r = await client.post(url + COMPLETIONS, json=body, timeout=timeout)
    except httpx.HTTPError as e:
        return Output(error=f"{type(e).__name__}: {e}")
    if r.status_code != 200:
        return Output(error=f"HTTP {r.status_code}: {r.text[:200]}")
    try:
        return Output.from_choice(r.json()["choices"][0])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return Output(error=f"bad response ({type(e).__name__}): {r.text[:200]}")


async def run_side(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    bodies: list[dict],
    concurrency: int,
    timeout: float,
) -> tuple[list[Output], float]:
    """Every body against one endpoint, at most `concurrency` in flight; outputs in body order."""
    sem = asyncio.Semaphore(concurrency)

    async def one(body: dict) -> Output:
        async with sem:
            return await _complete(client, url, {"model": model, **body}, timeout)

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(b) for b in bodies))
    return list(outs), time.perf_counter() - t0


async def run_verify(cfg: VerifyConfig) -> dict:
    if cfg.concurrency_a < 1 or cfg.concurrency_b < 1:
        raise BenchError("concurrency must be at least 1")
    try:
        wl = WorkloadConfig(input_len=cfg.input_len, output_len=cfg.output_len)
    except ValueError as e:
        raise BenchError(str(e)) from None
    async with httpx.AsyncClient(
        timeout=cfg.request_timeout_s, headers=api_key_headers()
    ) as client:
        model_a = cfg.model or await resolve_model(client, cfg.url_a)
        model_b = cfg.model or await resolve_model(client, cfg.url_b)
        # Size prompt text on A (two 1-token probes); both sides get the very same text.
        cal, _ = await calibrate(client, cfg.url_a, model_a, COMPLETIONS, cfg.seed)
        bodies = []
        for s in build_sessions(wl, cfg.num_prompts, cfg.seed, cal)[: cfg.num_prompts]:
            body = s.next_request().body
            body |= {"temperature": 0.0, "ignore_eos": True, "logprobs": 2}
            bodies.append(body)
        # A first, then B: with one URL for both, the runs must not share batches.
        outs_a, secs_a = await run_side(
            client, cfg.url_a, model_a, bodies, cfg.concurrency_a, cfg.request_timeout_s
        )
        outs_b, secs_b = await run_side(
            client, cfg.url_b, model_b, bodies, cfg.concurrency_b, cfg.request_timeout_s
        )
    if all(o.error for o in outs_a) or all(o.error for o in outs_b):
        side, outs = ("A", outs_a) if all(o.error for o in outs_a) else ("B", outs_b)
        raise BenchError(f"every request to {side} failed, e.g. {outs[0].error}")
    comparisons = [
        compare(i, a, b, cfg.near_tie) for i, (a, b) in enumerate(zip(outs_a, outs_b, strict=True))
    ]
    summary = summarize(comparisons)
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": asdict(cfg),
        "a": _side(cfg.url_a, model_a, cfg.concurrency_a, secs_a, outs_a),
        "b": _side(cfg.url_b, model_b, cfg.concurrency_b, secs_b, outs_b),
        "summary": summary,
        "prompts": [_prompt_dict(c) for c in comparisons],
        "exit_code": exit_code(summary),
    }


def _side(url: str, model: str, concurrency: int, secs: float, outs: list[Output]) -> dict:
    return {
        "url": url,
        "model": model,
        "concurrency": concurrency,
        "duration_s": round(secs, 3),
        "failed": sum(1 for o in outs if o.error),
        "output_tokens": sum(len(o.tokens) for o in outs),
    }


def _prompt_dict(c: Comparison) -> dict:
    d = asdict(c)
    del d["num_logprob_deltas"], d["sum_logprob_delta"]
    return d


# --- output -----------------------------------------------------------------------------------------


def _f(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(result: dict, out) -> None:
    a, b, s = result["a"], result["b"], result["summary"]
    out.write(f"A: {a['url']} ({a['model']}, concurrency {a['concurrency']}, {a['duration_s']}s)\n")
    out.write(f"B: {b['url']} ({b['model']}, concurrency {b['concurrency']}, {b['duration_s']}s)\n")
    out.write(
        f"{'#':>4}  {'result':<10} {'tokens A/B':>10} {'1st div':>7} {'A tok':>12} {'B tok':>12} "
        f"{'A top2 gap':>10} {'B in A top2':>11} {'max|dlp|':>9}\n"
    )
    for p in result["prompts"]:
        if p["error"]:
            out.write(f"{p['index']:>4}  {'error':<10} {p['error'][:80]}\n")
            continue
        status = "same" if p["identical"] else ("near-tie" if p["near_tie"] else "DIFFERENT")
        top = {None: "-", True: "yes", False: "no"}[p["b_token_in_ref_top"]]
        out.write(
            f"{p['index']:>4}  {status:<10} {str(p['a_tokens']) + '/' + str(p['b_tokens']):>10} "
            f"{_f(p['first_divergence'], 'd'):>7} {_tok(p['a_token']):>12} {_tok(p['b_token']):>12} "
            f"{_f(p['ref_top2_gap']):>10} {top:>11} {_f(p['max_logprob_delta']):>9}\n"
        )
    hist = ", ".join(f"{k}: {v}" for k, v in s["divergence_histogram"].items()) or "none"
    out.write(
        f"identical {s['identical']}/{s['num_prompts']}, different {s['different']} "
        f"(near-ties {s['near_tie']}), errors {s['errors']}\n"
        f"first divergence (token position: prompts): {hist}\n"
        f"logprob |delta| over common prefixes: max {_f(s['max_logprob_delta'], '.3g')}, "
        f"mean {_f(s['mean_logprob_delta'], '.3g')}\n"
        f"verdict: {s['verdict']}\n"
    )


def _tok(t: str | None) -> str:
    return "-" if t is None else repr(t)[:12]


# --- CLI --------------------------------------------------------------------------------------------


def add_verify_parser(subparsers) -> argparse.ArgumentParser:
    from kvrelay.bench.cli_shared import HelpFormatter

    v = subparsers.add_parser(
        "verify",
        formatter_class=HelpFormatter,
        help="send the same greedy prompts to two endpoints and compare the outputs token by token",
        description="Runs deterministic prompts greedily (temperature 0, ignore_eos, top-2 logprobs) "
        "on endpoint A, then on endpoint B, and compares them: identical or not, the first "
        "divergent token, A's top-2 logprob gap there (near-tie or real difference) and logprob "
        "deltas over the common prefix. Tokens are compared as strings (the API returns no ids). "
        "Exit 0: all identical; 1: any difference; 2: could not run.",
    )
    v.add_argument("url_a", metavar="URL_A", help="reference endpoint, e.g. http://127.0.0.1:8000")
    v.add_argument("url_b", metavar="URL_B", help="endpoint under test (may equal URL_A)")
    v.add_argument(
        "--model", default=None, help="model name to request (default: each server's first listed)"
    )
    v.add_argument("--num-prompts", type=int, default=16, help="prompts to compare")
    v.add_argument("--input-len", type=int, default=256, help="prompt tokens (approximate)")
    v.add_argument("--output-len", type=int, default=64, help="generated tokens per prompt")
    v.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    v.add_argument(
        "--concurrency", type=int, default=1, help="requests in flight on both endpoints"
    )
    v.add_argument("--concurrency-a", type=int, default=None, help="overrides --concurrency for A")
    v.add_argument("--concurrency-b", type=int, default=None, help="overrides --concurrency for B")
    v.add_argument(
        "--near-tie",
        type=float,
        default=DEFAULT_NEAR_TIE,
        help="a divergence where A's top-2 logprob gap is below this (nats) counts as a near-tie",
    )
    v.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before a request fails"
    )
    v.add_argument("--result-dir", default="bench-results", help="where the JSON file goes")
    v.add_argument(
        "--result-filename",
        default=None,
        help="JSON file name (default kvrelay-verify-TIMESTAMP.json)",
    )
    v.add_argument("--no-save", action="store_true", help="print the table only; write no file")
    from kvrelay.ledger.cli import add_ledger_arg

    add_ledger_arg(v)
    v.set_defaults(func=cmd_verify)
    return v


def cmd_verify(a: argparse.Namespace) -> int:
    """Exit 0: all identical; 1: any difference (file still written); 2: could not run."""
    from kvrelay.bench import report

    cfg = VerifyConfig(
        url_a=a.url_a.rstrip("/"),
        url_b=a.url_b.rstrip("/"),
        model=a.model,
        num_prompts=a.num_prompts,
        input_len=a.input_len,
        output_len=a.output_len,
        seed=a.seed,
        concurrency_a=a.concurrency_a or a.concurrency,
        concurrency_b=a.concurrency_b or a.concurrency,
        near_tie=a.near_tie,
        request_timeout_s=a.request_timeout,
    )
    started = time.time()
    try:
        if cfg.num_prompts < 1:
            raise BenchError("--num-prompts must be at least 1")
        result = asyncio.run(run_verify(cfg))
    except BenchError as e:
        sys.stderr.write(f"kvrelay verify: {e}\n")
        return 2
    print_report(result, sys.stdout)
    if not a.no_save:
        name = a.result_filename or time.strftime("kvrelay-verify-%Y%m%d-%H%M%S.json")
        path = report.write_json(result, Path(a.result_dir) / name)
        sys.stdout.write(f"wrote {path}\n")
    _record(a, cfg, result, started)
    return result["exit_code"]


def _record(a: argparse.Namespace, cfg: VerifyConfig, result: dict, started: float) -> None:
    """Into the ledger, under B's configuration (the endpoint under test); A's is kept beside."""
    from kvrelay.ledger.cli import save_run
    from kvrelay.ledger.record import fetch_server_info

    s = result["summary"]
    config = dict(result["config"])
    if cfg.url_a != cfg.url_b:
        config["a_server_info"] = fetch_server_info(cfg.url_a)
    save_run(
        a,
        "verify",
        config,
        result,
        server_url=cfg.url_b,
        workload=f"verify {cfg.num_prompts} prompts in={cfg.input_len} out={cfg.output_len} "
        f"c={cfg.concurrency_a}/{cfg.concurrency_b} vs {'itself' if cfg.url_a == cfg.url_b else cfg.url_a}",
        headline=f"{s['verdict']}: identical {s['identical']}/{s['num_prompts']}, different "
        f"{s['different']} (near-ties {s['near_tie']}), errors {s['errors']}",
        started_at=started,
        status="errors" if s["errors"] else "ok",
    )
