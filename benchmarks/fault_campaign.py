"""Fault campaign: a `kvrelay up` PD stack under a steady chat load, faults injected one at a time;
per fault: requests failed, seconds to recovery, and requests left hanging (must be 0: every
request ends with a response or an error within --request-bound seconds).

Faults (real processes, real signals):
  kill_decode_engine   SIGKILL the decode server's engine process (its HTTP process lives on)
  kill_prefill_engine  SIGKILL the prefill server's engine process
  kill_decode_server   SIGKILL the decode server's HTTP process (its engine dies with it)
  silent_decode        SIGSTOP decode's engine for --silent-s: its KV listener accepts and says
                       nothing, its steps stop; then SIGCONT
  restart_prefill      peer restart: SIGTERM prefill; the launcher starts a new instance (new
                       instance id and transfer identity) and decode must take it as its peer

    python benchmarks/fault_campaign.py --out benchmarks/results/fault_campaign_cpu.json
Short (tests/ops/test_fault_campaign.py): --faults silent_decode,kill_decode_engine

Exit 0: every fault recovered and no request hung; 1 otherwise; 2: the stack did not start.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvrelay.ops.procs import engine_pid

FAULTS = (
    "kill_decode_engine",
    "kill_prefill_engine",
    "kill_decode_server",
    "silent_decode",
    "restart_prefill",
)
EVENT_RE = re.compile(r"child=\w+ (exited|unhealthy|not healthy|healthy|stopped)|give_up")


class Stack:
    """`kvrelay up` as a subprocess; its log lines, time-stamped, collected by a reader thread."""

    def __init__(self, args: argparse.Namespace, log_dir: str) -> None:
        argv = [sys.executable, "-m", "kvrelay.cli", "up", "--port", "0", "--log-dir", log_dir]
        argv += ["--model", args.model, "--max-total-tokens", str(args.max_total_tokens)]
        argv += ["--health-timeout", str(args.start_timeout)]
        # The stack's own bounds, below the client's: a request must end inside them.
        argv += [f"--router-args=--request-timeout {args.router_timeout}"]
        argv += [f"--server-args=--transfer-timeout {args.transfer_timeout}"]
        env = dict(os.environ, KVRELAY_CPU_THREADS=str(args.cpu_threads))
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[tuple[float, str]] = []
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            self._q.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                line = self._q.get(timeout=0.5)
            except queue.Empty:
                continue
            if m := re.search(pattern, line):
                return m
        return None

    def pid_of(self, name: str) -> int:
        return [
            int(m[1]) for _, ln in self.lines if (m := re.search(rf"child={name} pid=(\d+)", ln))
        ][-1]

    def events(self, t0: float, t1: float) -> list[str]:
        """The launcher's supervision lines between two instants, without their time stamps."""
        return [
            ln.split(" kvrelay.launcher ", 1)[-1]
            for t, ln in self.lines
            if t0 <= t < t1 and EVENT_RE.search(ln)
        ]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- the load ---------------------------------------------------------------------------------------


@dataclass
class Outcome:
    start: float
    end: float
    status: str  # ok | error | hang
    detail: str = ""


class Load:
    """`concurrency` threads, each sending one chat completion after another until stopped."""

    def __init__(
        self, url: str, model: str, concurrency: int, max_tokens: int, bound_s: float
    ) -> None:
        self.url, self.model, self.max_tokens, self.bound_s = url, model, max_tokens, bound_s
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._worker, args=(i,), daemon=True)
            for i in range(concurrency)
        ]
        for t in self._threads:
            t.start()

    def _one(self, client: httpx.Client, n: int) -> Outcome:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": f"Count from {n} to {n + 5}."}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        t0 = time.monotonic()
        try:
            r = client.post(self.url + "/v1/chat/completions", json=body)
        except httpx.TimeoutException as e:
            return Outcome(
                t0,
                time.monotonic(),
                "hang",
                f"no answer within {self.bound_s:g}s ({type(e).__name__})",
            )
        except httpx.HTTPError as e:
            return Outcome(t0, time.monotonic(), "error", f"{type(e).__name__}")
        if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"):
            return Outcome(t0, time.monotonic(), "ok")
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text
        return Outcome(t0, time.monotonic(), "error", f"HTTP {r.status_code}: {msg[:100]}")

    def _worker(self, i: int) -> None:
        with httpx.Client(timeout=httpx.Timeout(self.bound_s, connect=10.0)) as client:
            n = i * 1000
            while not self._stop.is_set():
                o = self._one(client, n)
                n += 1
                with self._lock:
                    self.outcomes.append(o)
                if o.status != "ok":
                    time.sleep(0.2)  # a down stack answers at once: do not spin

    def since(self, t: float) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.start >= t]

    def stop(self) -> None:
        """Every request in flight ends (each within the bound) before this returns."""
        self._stop.set()
        for t in self._threads:
            t.join()


# --- faults -----------------------------------------------------------------------------------------


def inject(fault: str, stack: Stack, silent_s: float) -> None:
    if fault == "kill_decode_engine":
        os.kill(engine_pid(stack.pid_of("decode")), signal.SIGKILL)
    elif fault == "kill_prefill_engine":
        os.kill(engine_pid(stack.pid_of("prefill")), signal.SIGKILL)
    elif fault == "kill_decode_server":
        os.kill(stack.pid_of("decode"), signal.SIGKILL)
    elif fault == "silent_decode":
        pid = engine_pid(stack.pid_of("decode"))
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(silent_s)
        finally:
            os.kill(pid, signal.SIGCONT)
    elif fault == "restart_prefill":
        os.kill(stack.pid_of("prefill"), signal.SIGTERM)
    else:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")


def wait_recovery(load: Load, since: float, timeout_s: float) -> float | None:
    """Seconds from `since` to the end of the first successful request started after it."""
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        ok = [o.end for o in load.since(since) if o.status == "ok"]
        if ok:
            return round(min(ok) - since, 2)
        time.sleep(0.2)
    return None


def summarize(fault: str, outs: list[Outcome], recovery_s: float | None, events: list[str]) -> dict:
    count = Counter(o.status for o in outs)
    causes = Counter(o.detail for o in outs if o.status != "ok")
    return {
        "fault": fault,
        "requests": len(outs),
        "ok": count["ok"],
        "failed": count["error"],
        "hanging": count["hang"],
        "recovered": recovery_s is not None,
        "recovery_s": recovery_s,
        "max_latency_s": round(max((o.end - o.start for o in outs), default=0.0), 2),
        "failure_causes": dict(causes.most_common(5)),
        "launcher_events": events,
    }


def run(args: argparse.Namespace) -> dict:
    faults = [f for f in args.faults.split(",") if f]
    for f in faults:
        if f not in FAULTS:
            raise SystemExit(f"unknown fault {f!r}; known: {', '.join(FAULTS)}")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvrelay-faults-")
    t_start = time.monotonic()
    stack = Stack(args, log_dir)
    result: dict = {
        "schema": "kvrelay-fault-campaign/1",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": vars(args) | {"faults": faults, "log_dir": log_dir},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "faults": [],
    }
    load = None
    try:
        m = stack.wait_for(r"kvrelay up ready: (http://\S+) ", args.start_timeout + 30)
        if m is None:
            result.update(verdict="the stack did not start", exit_code=2)
            return result
        url = m[1]
        result["startup_s"] = round(time.monotonic() - t_start, 1)
        load = Load(url, args.model, args.concurrency, args.max_tokens, args.request_bound)
        if wait_recovery(load, time.monotonic(), args.recovery_timeout) is None:
            result.update(verdict="no request succeeded before the first fault", exit_code=2)
            return result
        marks: list[tuple[str, float, float | None]] = []
        for fault in faults:
            time.sleep(args.settle_s)  # steady load before the fault
            t0 = time.monotonic()
            print(f"fault_campaign: inject {fault}", flush=True)
            inject(fault, stack, args.silent_s)
            rec = wait_recovery(load, t0, args.recovery_timeout)
            print(f"fault_campaign: {fault} recovery_s={rec}", flush=True)
            marks.append((fault, t0, rec))
            if rec is None:
                break  # the stack did not come back: later faults would measure nothing
        time.sleep(args.settle_s)
        load.stop()
        t_end = time.monotonic() + 1
        for i, (fault, t0, rec) in enumerate(marks):
            t1 = marks[i + 1][1] if i + 1 < len(marks) else t_end
            # By the time a request ended: one in flight when the next fault struck is its.
            outs = [o for o in load.outcomes if t0 <= o.end < t1]
            result["faults"].append(summarize(fault, outs, rec, stack.events(t0, t1)))
    finally:
        if load is not None:
            load.stop()
        stack.stop()
    hung = sum(f["hanging"] for f in result["faults"])
    unrecovered = [f["fault"] for f in result["faults"] if not f["recovered"]]
    missing = len(result["faults"]) < len(faults)
    result["requests"] = len(load.outcomes) if load else 0
    result["hanging"] = hung
    if hung or unrecovered or missing:
        result.update(verdict=f"hanging requests {hung}, not recovered {unrecovered}", exit_code=1)
    else:
        result.update(verdict="every fault recovered, no request hung", exit_code=0)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated, in order: {', '.join(FAULTS)}"
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--concurrency", type=int, default=3, help="load: requests in flight")
    p.add_argument("--max-tokens", type=int, default=8, help="load: max_tokens of each request")
    p.add_argument(
        "--request-bound",
        type=float,
        default=60.0,
        help="seconds: a request without an answer by then hangs",
    )
    p.add_argument(
        "--router-timeout", type=float, default=40.0, help="the router's --request-timeout"
    )
    p.add_argument(
        "--transfer-timeout", type=float, default=30.0, help="the servers' --transfer-timeout"
    )
    p.add_argument(
        "--silent-s",
        type=float,
        default=8.0,
        help="silent_decode: seconds decode's engine is stopped",
    )
    p.add_argument(
        "--settle-s", type=float, default=3.0, help="seconds of steady load before each fault"
    )
    p.add_argument(
        "--recovery-timeout", type=float, default=300.0, help="seconds a fault may take to recover"
    )
    p.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds the stack may take to start"
    )
    p.add_argument("--cpu-threads", type=int, default=1, help="KVRELAY_CPU_THREADS of the servers")
    p.add_argument(
        "--log-dir", default=None, help="the stack's logs (default: a temporary directory)"
    )
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    for f in result["faults"]:
        print(
            f"{f['fault']:>20}: requests {f['requests']}, failed {f['failed']}, hanging {f['hanging']}, "
            f"recovery {f['recovery_s']}s",
            file=sys.stderr,
        )
    print(f"verdict: {result['verdict']}", file=sys.stderr)
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
