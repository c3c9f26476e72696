"""Fault campaign: a `kvrelay up` PD stack under concurrent chat load, hundreds of faults injected;
every answer judged against a single server's greedy tokens. Per fault kind: faults, requests,
correct, failed with a named cause, silent failures (200 with wrong tokens, or no [DONE]) and hangs
(both must be 0), time-to-error p50/p99, and what each server still holds once idle (must be 0).

Per-request faults (test flags of the prefill server; one stack per flag):
  corrupt     --test-corrupt-transfer P: a KV piece damaged after checksumming; decode must
              detect it and the request fail with a named cause
  delay       --test-delay-transfer D beyond a short --transfer-timeout: the transfer times out
  disconnect  the client closes a streamed answer after --cut-after chunks; the stack must free it
Load faults (one stack each; no process is hurt, so the launcher must restart nothing):
  overload    --overload-concurrency clients (past httpx's pool of 100 and past the router's
              --max-concurrent-requests, set to --overload-limit; the servers' --max-running-
              requests set low too, so they queue): a request past the router's limit must get
              a clear 429/503 with Retry-After (its latency reported), every other request
              must be correct, and the router must hold no more than its limit, nor anything
              once idle
  slow_peer   one server (--slow-roles: decode, prefill) sleeps --slow-step-s in every batch
              step (--test-step-delay): requests queue, or fail with a named cause within the
              router's --request-timeout; none hangs, none is silent, nothing is restarted
  stranger    a process on the host attacks the stack under load (fault_strangers.py): floods
              of idle and garbage connections to decode's transfer port, slowloris connections
              to every HTTP listener, Content-Length + Transfer-Encoding bodies, replayed and
              stale signed PD bodies; each must be refused and counted, the load unharmed
Process faults (real signals, the launcher restarts what died), --kills of each:
  kill_prefill_server, kill_decode_server   SIGKILL the server's HTTP process (engine dies too)
  kill_prefill_engine, kill_decode_engine   SIGKILL the engine process alone
  silent_decode     SIGSTOP decode's engine for --silent-s, then SIGCONT (not in the default set)
  restart_prefill   SIGTERM prefill: a new instance id that decode must take (not in the default)

    python benchmarks/fault_campaign.py --out benchmarks/results/fault_campaign_cpu.json
Short (tests/ops/test_fault_campaign.py): --phases corrupt,disconnect,overload --kill-kinds ''

Exit 0: no silent failure, no hang, nothing held idle, every kill recovered, and no load phase
problem (an unclear rejection, an admitted request not correct, a restart); 1 otherwise;
2: a stack did not start.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from fault_stack import (  # same directory
    PROMPTS,
    GaugePeak,
    Load,
    Outcome,
    Stack,
    held_when_idle,
    oracle_tokens,
    router_counters,
    router_gauge,
)
from fault_strangers import stranger_attacks  # same directory

from kvrelay.ops.procs import engine_pid

KILLS = (
    "kill_prefill_server",
    "kill_decode_server",
    "kill_prefill_engine",
    "kill_decode_engine",
    "silent_decode",
    "restart_prefill",
)
DEFAULT_KILLS = KILLS[:4]
PER_REQUEST = ("corrupt", "disconnect", "delay")
LOAD = ("overload", "slow_peer", "stranger")
PHASES = PER_REQUEST + LOAD
ROUTER_LIMIT_FLAG = "--max-concurrent-requests"
VERDICTS = ("correct", "failed_named", "failed_unnamed", "silent", "hang", "cut")


def inject(kind: str, stack: Stack, silent_s: float) -> None:
    if kind == "kill_prefill_server":
        os.kill(stack.pid_of("prefill"), signal.SIGKILL)
    elif kind == "kill_decode_server":
        os.kill(stack.pid_of("decode"), signal.SIGKILL)
    elif kind == "kill_prefill_engine":
        os.kill(engine_pid(stack.pid_of("prefill")), signal.SIGKILL)
    elif kind == "kill_decode_engine":
        os.kill(engine_pid(stack.pid_of("decode")), signal.SIGKILL)
    elif kind == "silent_decode":
        pid = engine_pid(stack.pid_of("decode"))
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(silent_s)
        finally:
            os.kill(pid, signal.SIGCONT)
    elif kind == "restart_prefill":
        os.kill(stack.pid_of("prefill"), signal.SIGTERM)
    else:
        raise ValueError(f"unknown fault {kind!r}; known: {', '.join(KILLS)}")


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(int(q * len(xs)), len(xs) - 1)], 3)


def faults_met(phase: str, outs: list[Outcome], router: Counter) -> Counter:
    """Injected faults the stack met: damaged and late transfers as the router counted their
    failed attempts (a retried attempt is a fault too), disconnects as the client made them."""
    f = Counter(
        corrupt=router["checksum_mismatch"],
        delay=router["transfer_timeout"] if phase == "delay" else 0,
        disconnect=sum(o.status == "cut" for o in outs),
    )
    return +f  # drop the zeros


def summarize(
    phase: str, faults: Counter, outs: list[Outcome], idle: dict, router: Counter, **extra
) -> dict:
    v = Counter(o.verdict for o in outs)
    faults = faults + faults_met(phase, outs, router)
    errs = [o.end - o.start for o in outs if o.status == "error"]
    return {
        "phase": phase,
        "faults": dict(faults),
        "requests": len(outs),
        **{k: v[k] for k in VERDICTS},
        "time_to_error_p50_s": pct(errs, 0.5),
        "time_to_error_p99_s": pct(errs, 0.99),
        "max_latency_s": round(max((o.end - o.start for o in outs), default=0.0), 2),
        "causes": dict(Counter(o.cause for o in outs if o.status == "error").most_common(6)),
        "silent_examples": [
            {"prompt": o.prompt, "tokens": o.tokens} for o in outs if o.verdict == "silent"
        ][:3],
        "router": dict(router),  # its failed attempts by cause, retries, disconnects seen
        "held_when_idle": idle["held"],
        "idle_drain_s": idle["drain_s"],
        "problems": [],  # a load phase's own checks that failed (verdict: each fails the run)
        **extra,
    }


def start(
    args, log_dir: str, extra: list[str], result: dict, router_args: str = ""
) -> tuple[Stack, str] | None:
    t0 = time.monotonic()
    stack = Stack(args, log_dir, extra, router_args)
    try:
        m = stack.wait_for(r"kvrelay up ready: (http://\S+) ", args.start_timeout + 30)
    except BaseException:  # Ctrl-C while it starts: the stack must not outlive the campaign
        stack.stop()
        raise
    if m is None:
        stack.stop()
        return None
    result["startup_s"].append(round(time.monotonic() - t0, 1))
    return stack, m[1]


def servers(stack: Stack) -> dict[str, str]:
    return {n: stack.url_of(n) for n in ("prefill", "decode")}


def per_request_phase(kind: str, stack: Stack, url: str, args, oracle: dict) -> dict:
    """Load until --faults-per-kind faults of this kind or --phase-s seconds; then idle check."""

    def is_fault(o: Outcome) -> bool:  # the phase's own fault, as the client sees it
        if kind == "corrupt":
            return "checksum" in o.cause
        return o.status == "cut" if kind == "disconnect" else True

    t0, r0 = time.monotonic(), router_counters(url)
    cut = args.cut_after if kind == "disconnect" else 0
    conc = args.delay_concurrency if kind == "delay" else 0  # delayed requests mostly wait
    load = Load(url, args, oracle, cut_after=cut, concurrency=conc)
    while time.monotonic() - t0 < args.phase_s and load.count(is_fault) < args.faults_per_kind:
        time.sleep(0.5)
    outs = load.stop()
    idle = held_when_idle(servers(stack), args.idle_timeout)
    wall = round(time.monotonic() - t0, 1)
    r = summarize(kind, Counter(), outs, idle, router_counters(url) - r0, wall_s=wall)
    print(
        f"fault_campaign: {kind} faults={r['faults']} requests={r['requests']} "
        f"silent={r['silent']} hang={r['hang']} held={r['held_when_idle']}",
        flush=True,
    )
    return r


def kill_phase(kind: str, stack: Stack, url: str, args, oracle: dict) -> dict:
    """Under load: inject, wait until a correct answer comes after the fault, stop; idle check."""
    load = Load(url, args, oracle)
    time.sleep(args.settle_s)  # steady load before the fault
    t0 = time.monotonic()
    restarts0, r0 = stack.restarts(), router_counters(url)
    inject(kind, stack, args.silent_s)
    rec = None
    while time.monotonic() - t0 < args.recovery_timeout:
        ok = [o.end for o in load.since(t0) if o.verdict == "correct"]
        if ok:
            rec = round(min(ok) - t0, 2)
            break
        time.sleep(0.5)
    outs = load.stop()
    idle = held_when_idle(servers(stack), args.idle_timeout)
    t1 = time.monotonic()
    r = summarize(
        kind,
        Counter({kind: 1}),
        [o for o in outs if o.end >= t0],  # the fault's requests: those that ended after it
        idle,
        router_counters(url) - r0,
        recovered=rec is not None,
        recovery_s=rec,
        restarts=stack.restarts() - restarts0,
        launcher_events=stack.events(t0, t1),
    )
    print(
        f"fault_campaign: {kind} recovery_s={rec} silent={r['silent']} hang={r['hang']}", flush=True
    )
    return r


def _seconds(xs: list[float]) -> dict:
    return {"p50": pct(xs, 0.5), "p99": pct(xs, 0.99), "max": pct(xs, 1.0)}


def overload_phase(stack: Stack, url: str, args, oracle: dict) -> dict:
    """--overload-concurrency clients against a router limited to --overload-limit requests in
    flight, for --overload-s. Checked: every request past the limit is turned away clearly (429,
    or 503 with a cause that says overloaded, and a Retry-After either way), every admitted one
    is correct, the router held at most its limit and holds nothing once idle, nothing was
    restarted (a router busy turning clients away is not a dead one: issue 27)."""
    t0, r0, restarts0 = time.monotonic(), router_counters(url), stack.restarts()
    peak = GaugePeak(url)
    load = Load(url, args, oracle, concurrency=args.overload_concurrency)
    while time.monotonic() - t0 < args.overload_s:
        time.sleep(0.5)
    outs = load.stop()
    inflight_peak = peak.stop()
    idle = held_when_idle(servers(stack), args.idle_timeout)
    inflight_idle = router_gauge(url)
    t1 = time.monotonic()
    rejected = [o for o in outs if o.rejected]
    unclear = [o for o in rejected if o.retry_after is None or o.http_status not in (429, 503)]
    admitted = [o for o in outs if not o.rejected]
    wrong = [o for o in admitted if o.verdict != "correct"]
    restarts = stack.restarts() - restarts0
    r = summarize(
        "overload",
        Counter(overloaded=len(rejected)),
        outs,
        idle,
        router_counters(url) - r0,
        wall_s=round(t1 - t0, 1),
        limit=args.overload_limit,
        concurrency=args.overload_concurrency,
        rejected=len(rejected),
        rejected_unclear=len(unclear),
        rejection_status=dict(Counter(str(o.http_status) for o in rejected)),
        rejection_causes=dict(Counter(o.cause for o in rejected).most_common(4)),
        retry_after=dict(Counter(str(o.retry_after) for o in rejected).most_common(4)),
        time_to_rejection_s=_seconds([o.end - o.start for o in rejected]),
        admitted=len(admitted),
        admitted_not_correct=dict(Counter(f"{o.verdict}: {o.cause}" for o in wrong).most_common(6)),
        router_inflight_peak=inflight_peak,
        router_inflight_idle=inflight_idle,
        restarts=restarts,
        launcher_events=stack.events(t0, t1),
    )
    problems = r["problems"]
    if not rejected:
        problems.append(
            f"the limit of {args.overload_limit} was never reached: no request turned away"
        )
    if unclear:
        problems.append(f"{len(unclear)} rejections without Retry-After or not 429/503")
    if wrong:
        problems.append(f"{len(wrong)} admitted requests not correct: {r['admitted_not_correct']}")
    if inflight_peak is not None and inflight_peak > args.overload_limit:
        problems.append(f"the router held {inflight_peak:g} requests, past its limit")
    if inflight_idle:  # None: a router without the gauge; 0: nothing held
        problems.append(f"the router holds {inflight_idle:g} requests once idle")
    if restarts:
        problems.append(f"{restarts} restarts under load alone: {r['launcher_events']}")
    print(
        f"fault_campaign: overload requests={len(outs)} rejected={len(rejected)} "
        f"admitted={len(admitted)} correct={r['correct']} problems={problems}",
        flush=True,
    )
    return r


def slow_peer_phase(role: str, stack: Stack, url: str, args, oracle: dict) -> dict:
    """Load on a stack whose `role` server sleeps --slow-step-s in every batch step, for
    --slow-s. Each request is correct or fails with a named cause (silent, hang and unnamed
    are counted as everywhere) within the router's --request-timeout; the slow server is slow,
    not dead: nothing is restarted. A --slow-step-s x --max-tokens past --router-timeout makes
    every request outlast the router: then each must fail, named, by its timeout."""
    t0, r0, restarts0 = time.monotonic(), router_counters(url), stack.restarts()
    load = Load(url, args, oracle, concurrency=args.slow_concurrency)
    while time.monotonic() - t0 < args.slow_s:
        time.sleep(0.5)
    outs = load.stop()
    idle = held_when_idle(servers(stack), args.idle_timeout)
    t1 = time.monotonic()
    restarts = stack.restarts() - restarts0
    oks = [o.end - o.start for o in outs if o.verdict == "correct"]
    r = summarize(
        "slow_peer",
        Counter({f"slow_{role}": 1}),
        outs,
        idle,
        router_counters(url) - r0,
        wall_s=round(t1 - t0, 1),
        slow_role=role,
        step_delay_s=args.slow_step_s,
        concurrency=args.slow_concurrency,
        latency_correct_s=_seconds(oks),
        restarts=restarts,
        launcher_events=stack.events(t0, t1),
    )
    if restarts:
        r["problems"].append(
            f"{restarts} restarts of a slow (not dead) stack: {r['launcher_events']}"
        )
    # The router's --request-timeout bounds a request end to end: its error must come by then.
    bound = args.router_timeout + max(2.0, 0.1 * args.router_timeout)
    late = [o.end - o.start for o in outs if o.status == "error" and o.end - o.start > bound]
    if late:
        r["problems"].append(
            f"{len(late)} failures came after the router's --request-timeout of "
            f"{args.router_timeout:g}s (latest {max(late):.1f}s)"
        )
    print(
        f"fault_campaign: slow_peer role={role} requests={r['requests']} correct={r['correct']} "
        f"failed_named={r['failed_named']} silent={r['silent']} hang={r['hang']} "
        f"held={r['held_when_idle']} problems={r['problems']}",
        flush=True,
    )
    return r


STRANGER_SECRET = "fault-campaign-stranger-phase"  # stack E's PD secret (KVRELAY_PD_SECRET)


def stranger_phase(stack: Stack, url: str, args, oracle: dict) -> dict:
    """Load while fault_strangers attacks the stack; every attack refused and counted (else a
    problem), the load judged as everywhere, nothing restarted, nothing held once idle."""
    t0, r0, restarts0 = time.monotonic(), router_counters(url), stack.restarts()
    load = Load(url, args, oracle)
    time.sleep(args.settle_s)  # prefill's connection to decode is up before the flood
    urls = {"router": url, **servers(stack)}
    faults, details, problems = stranger_attacks(urls, args.model, STRANGER_SECRET, args)
    outs = load.stop()
    idle = held_when_idle(servers(stack), args.idle_timeout)
    t1 = time.monotonic()
    restarts = stack.restarts() - restarts0
    r = summarize(
        "stranger",
        faults,
        outs,
        idle,
        router_counters(url) - r0,
        wall_s=round(t1 - t0, 1),
        restarts=restarts,
        launcher_events=stack.events(t0, t1),
        **details,
    )
    r["problems"] += problems
    if restarts:
        r["problems"].append(f"{restarts} restarts under strangers: {r['launcher_events']}")
    print(
        f"fault_campaign: stranger faults={dict(faults)} requests={r['requests']} "
        f"correct={r['correct']} silent={r['silent']} hang={r['hang']} problems={r['problems']}",
        flush=True,
    )
    return r


def router_has_flag(flag: str) -> bool:
    """Does this checkout's `kvrelay router` take `flag`? (The overload phase needs its limit.)"""
    argv = [sys.executable, "-m", "kvrelay.cli", "router", "--help"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    return flag in p.stdout


def run(args: argparse.Namespace) -> dict:
    phases = [p for p in args.phases.split(",") if p]
    kills = [k for k in args.kill_kinds.split(",") if k]
    for k in kills:
        if k not in KILLS:
            raise SystemExit(f"unknown kill {k!r}; known: {', '.join(KILLS)}")
    for p in phases:
        if p not in PHASES:
            raise SystemExit(f"unknown phase {p!r}; known: {', '.join(PHASES)}")
    slow_roles = [r for r in args.slow_roles.split(",") if r]
    for role in slow_roles:
        if role not in ("prefill", "decode"):
            raise SystemExit(f"unknown --slow-roles {role!r}; known: prefill, decode")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvrelay-faults-")
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    result: dict = {
        "schema": "kvrelay-fault-campaign/2",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": vars(args) | {"log_dir": log_dir},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "prompts": len(PROMPTS),
        "oracle": "a single `kvrelay serve` (role single), greedy, the same prompts and max_tokens",
        "startup_s": [],
        "kinds": [],
        "skipped": [],
        "restarts": 0,
    }
    oracle = oracle_tokens(args, f"{log_dir}/oracle.log")
    result["oracle_s"] = round(time.monotonic() - t_start, 1)
    timeout = [f"--server-args=--transfer-timeout {args.transfer_timeout}"]
    # Stack A: corrupted transfers at rate P (the rest must be correct), disconnects, kills.
    stacks = []
    a_phases = [p for p in phases if p in ("corrupt", "disconnect")]
    if a_phases or kills:
        extra = timeout + [f"--prefill-args=--test-corrupt-transfer {args.corrupt_p}"]
        extra += [f"--decode-args={args.decode_args}"] if args.decode_args else []
        stacks.append(("A", extra, a_phases, kills))
    if "delay" in phases:
        extra = [f"--server-args=--transfer-timeout {args.delay_timeout}"]
        extra += [f"--prefill-args=--test-delay-transfer {args.delay_s}"]
        stacks.append(("B", extra, ["delay"], []))
    router_args = {}
    if "overload" in phases:
        if router_has_flag(ROUTER_LIMIT_FLAG):
            # Stack C: the router's limit, and servers that run fewer than it (the rest queue).
            t, srv = args.transfer_timeout, args.overload_server_args
            extra = [f"--server-args=--transfer-timeout {t} {srv}".strip()]
            router_args["C"] = f"{ROUTER_LIMIT_FLAG} {args.overload_limit}"
            stacks.append(("C", extra, ["overload"], []))
        else:
            result["skipped"].append(f"overload: `kvrelay router` has no {ROUTER_LIMIT_FLAG} yet")
    if "slow_peer" in phases:
        for role in slow_roles:  # Stack D-<role>: that server sleeps in every batch step
            extra = timeout + [f"--{role}-args=--test-step-delay {args.slow_step_s}"]
            stacks.append((f"D-{role}", extra, [f"slow_peer:{role}"], []))
    if "stranger" in phases:  # Stack E: a secret the phase knows, to sign as a captured body
        stacks.append(("E", timeout, ["stranger"], []))
    for name, extra, pr_phases, kill_kinds in stacks:
        if name == "E":
            os.environ["KVRELAY_PD_SECRET"] = STRANGER_SECRET  # `kvrelay up` takes it
        try:
            started = start(
                args, f"{log_dir}/stack{name}", extra, result, router_args.get(name, "")
            )
        finally:
            if name == "E":
                os.environ.pop("KVRELAY_PD_SECRET", None)
        if started is None:
            result.update(verdict=f"stack {name} did not start", exit_code=2)
            return result
        stack, url = started
        try:
            for kind in pr_phases:
                if kind == "overload":
                    r = overload_phase(stack, url, args, oracle)
                elif kind == "stranger":
                    r = stranger_phase(stack, url, args, oracle)
                elif kind.startswith("slow_peer:"):
                    r = slow_peer_phase(kind.split(":", 1)[1], stack, url, args, oracle)
                else:
                    r = per_request_phase(kind, stack, url, args, oracle)
                result["kinds"].append(r)
            for kind in kill_kinds:
                for _ in range(args.kills):
                    result["kinds"].append(kill_phase(kind, stack, url, args, oracle))
            result["restarts"] += stack.restarts()
        finally:
            stack.stop()
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    return verdict(result)


def verdict(result: dict) -> dict:
    ks = result["kinds"]
    tot: dict = {k: sum(r[k] for r in ks) for k in ("requests", *VERDICTS)}
    per_kind = sum((Counter(r["faults"]) for r in ks), Counter())
    tot["faults"] = sum(per_kind.values())
    result["faults_per_kind"] = dict(per_kind)
    held = [r["phase"] for r in ks if r["held_when_idle"]]
    unrecovered = [r["phase"] for r in ks if r.get("recovered") is False]
    problems = [f"{r['phase']}: {p}" for r in ks for p in r.get("problems", [])]
    result["totals"] = tot
    result["problems"] = problems
    bad = tot["silent"] or tot["hang"] or tot["failed_unnamed"] or held or unrecovered or problems
    skipped = f"; skipped: {result['skipped']}" if result.get("skipped") else ""
    if bad:
        result.update(
            verdict=f"silent {tot['silent']}, hangs {tot['hang']}, unnamed failures "
            f"{tot['failed_unnamed']}, held idle after {held}, not recovered {unrecovered}, "
            f"problems {problems}{skipped}",
            exit_code=1,
        )
    else:
        result.update(
            verdict=f"{tot['faults']} faults: no silent failure, no hang, nothing held idle"
            + (", no load-phase problem" if any(r["phase"] in LOAD for r in ks) else "")
            + skipped,
            exit_code=0,
        )
    return result


def table(result: dict) -> str:
    """One row per phase (kill phases of a kind merged): the NOTES table."""
    rows = [
        "| phase | faults injected | requests | correct | failed, named cause | silent | hangs "
        "| time-to-error p50 / p99 | held idle | restarts |",
        "|" + "---|" * 10,
    ]
    by: dict[str, list[dict]] = {}
    for r in result["kinds"]:
        name = r["phase"] + (f" ({r['slow_role']})" if r.get("slow_role") else "")
        by.setdefault(name, []).append(r)
    for phase, rs in by.items():
        s = {k: sum(r[k] for r in rs) for k in ("requests", *VERDICTS)}
        faults = sum((Counter(r["faults"]) for r in rs), Counter())
        f = ", ".join(f"{k} {n}" for k, n in faults.most_common())
        p50 = statistics.median([r["time_to_error_p50_s"] or 0 for r in rs])
        p99 = max(r["time_to_error_p99_s"] or 0 for r in rs)
        held = sum(bool(r["held_when_idle"]) for r in rs)
        rows.append(
            f"| {phase} | {f} | {s['requests']} | {s['correct']} | {s['failed_named']} | "
            f"{s['silent'] + s['failed_unnamed']} | {s['hang']} | {p50:.2f} / {p99:.2f} s | "
            f"{held} | {sum(r.get('restarts', 0) for r in rs)} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--phases", default=",".join(PHASES), help=f"per-request and load phases: {PHASES}")
    add("--kill-kinds", default=",".join(DEFAULT_KILLS), help=f"process faults: {KILLS}")
    add("--kills", type=int, default=2, help="times each process fault is injected")
    add("--faults-per-kind", type=int, default=300, help="a per-request phase ends at this many")
    add("--phase-s", type=float, default=90.0, help="... or after this many seconds")
    add("--model", default="smollm2")
    add("--max-total-tokens", type=int, default=8192)
    add("--concurrency", type=int, default=8, help="load: requests in flight")
    add("--max-tokens", type=int, default=8, help="load: max_tokens of each request")
    add("--request-bound", type=float, default=60.0, help="s: no answer by then is a hang")
    add("--router-timeout", type=float, default=40.0, help="the router's --request-timeout")
    add("--transfer-timeout", type=float, default=30.0, help="servers' --transfer-timeout")
    add("--corrupt-p", type=float, default=0.8, help="corrupt: share of transfers damaged")
    add("--delay-s", type=float, default=2.0, help="delay: seconds every KV piece is late")
    add("--delay-timeout", type=float, default=1.0, help="delay: the servers' --transfer-timeout")
    add("--delay-concurrency", type=int, default=24, help="delay: requests in flight")
    add("--cut-after", type=int, default=1, help="disconnect: chunks read before closing")
    add("--overload-s", type=float, default=60.0, help="overload: seconds of load")
    add("--overload-concurrency", type=int, default=128, help="overload: requests in flight")
    add("--overload-limit", type=int, default=8, help="overload: router --max-concurrent-requests")
    add(
        "--overload-server-args",
        default="--max-running-requests 4",
        help="overload: more `kvrelay serve` args for both servers (default: fewer running "
        "requests than the router admits, so the servers queue too)",
    )
    add("--slow-roles", default="decode,prefill", help="slow_peer: which server is slow, each")
    add("--slow-step-s", type=float, default=0.5, help="slow_peer: --test-step-delay of it")
    add("--slow-s", type=float, default=60.0, help="slow_peer: seconds of load")
    add("--slow-concurrency", type=int, default=16, help="slow_peer: requests in flight")
    add("--flood-rounds", type=int, default=3, help="stranger: transfer-port flood rounds")
    add("--flood-idle", type=int, default=150, help="stranger: idle connections per round")
    add("--flood-garbage", type=int, default=50, help="stranger: garbage connections per round")
    add("--slowloris-per-target", type=int, default=100, help="stranger: per HTTP listener")
    add("--stranger-requests", type=int, default=20, help="stranger: CL+TE bodies, replays, stale")
    add("--idle-timeout", type=float, default=20.0, help="s an idle server may take to free all")
    add("--silent-s", type=float, default=8.0, help="silent_decode: seconds decode is stopped")
    add("--settle-s", type=float, default=3.0, help="seconds of steady load before a kill")
    add("--recovery-timeout", type=float, default=300.0, help="s a kill may take to recover")
    add("--start-timeout", type=float, default=600.0, help="s a stack may take to start")
    add("--cpu-threads", type=int, default=1, help="KVRELAY_CPU_THREADS of the servers")
    add(
        "--decode-args",
        default="",
        help="more `kvrelay serve` args for stack A's decode; the oracle's check: "
        "'--test-fault-swap-token 0.5,0' must make the campaign report silent failures",
    )
    add("--log-dir", default=None, help="the stacks' logs (default: a temporary directory)")
    add("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    print(table(result), file=sys.stderr)
    print(f"verdict: {result['verdict']}", file=sys.stderr)
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
