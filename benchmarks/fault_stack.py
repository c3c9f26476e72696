"""Helpers of the fault campaign (fault_campaign.py): the stack under test, the single-server
oracle, one classified completion request, the concurrent load and the idle-gauge check."""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

# Short completion prompts: prefill is the CPU's bottleneck, and a fault needs only a transfer.
PROMPTS = [f"Count from {n} to {n + 5}:" for n in range(0, 60, 5)] + [
    "Three colours:",
    "The capital of France is",
    "A haiku about rain:",
    "Hello in Spanish:",
]
EVENT_RE = re.compile(r"child=\w+ (exited|unhealthy|not healthy|healthy|stopped)|give_up")
# Gauges that must read 0 on an idle server: KV pages, requests, PD transfers in any state.
IDLE_GAUGES = re.compile(
    r"^(kvrelay_kv_pages_used|kvrelay_num_requests_running|kvrelay_num_requests_waiting"
    r"|kvrelay_pd_transfers)(\{[^}]*\})? ([0-9.e+-]+)$",
    re.M,
)


class Stack:
    """`kvrelay up` as a subprocess; its log lines, time-stamped, collected by a reader thread."""

    def __init__(
        self, args: argparse.Namespace, log_dir: str, extra: list[str], router_args: str = ""
    ) -> None:
        argv = [sys.executable, "-m", "kvrelay.cli", "up", "--port", "0", "--log-dir", log_dir]
        argv += ["--model", args.model, "--max-total-tokens", str(args.max_total_tokens)]
        argv += ["--health-timeout", str(args.start_timeout)]
        # The stack's own bounds, below the client's: a request must end inside them.
        argv += [f"--router-args=--request-timeout {args.router_timeout} {router_args}".strip()]
        argv += extra
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

    def _last(self, name: str, group: int) -> str:
        pat = rf"child={name} pid=(\d+) url=(\S+)"
        return [m[group] for _, ln in self.lines if (m := re.search(pat, ln))][-1]

    def pid_of(self, name: str) -> int:
        return int(self._last(name, 1))

    def url_of(self, name: str) -> str:
        return self._last(name, 2)

    def restarts(self) -> int:
        """Restarts the launcher performed (the highest `restarts=` each child reached, summed)."""
        top: dict[str, int] = {}
        for _, ln in self.lines:
            if m := re.search(r"child=(\w+) .*restarts=(\d+)", ln):
                top[m[1]] = max(top.get(m[1], 0), int(m[2]))
        return sum(top.values())

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def oracle_tokens(args: argparse.Namespace, log_path: str) -> dict[str, list[str]]:
    """Greedy tokens of every prompt from a single server (`kvrelay serve`, role single)."""
    port = free_port()
    argv = [sys.executable, "-m", "kvrelay.cli", "serve", "--model", args.model, "--port"]
    argv += [str(port), "--max-total-tokens", str(args.max_total_tokens)]
    env = dict(os.environ, KVRELAY_CPU_THREADS=str(args.cpu_threads))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.start_timeout
        with httpx.Client(timeout=2) as http:  # httpx.get: a client per call, ~30 ms of CPU
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise SystemExit(f"the oracle server exited rc={proc.returncode}: {log_path}")
                try:
                    if http.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        out: dict[str, list[str]] = {}
        with httpx.Client(timeout=120) as c:
            for p in PROMPTS:
                o = request(c, url, args.model, p, args.max_tokens, 120.0)
                if o.status != "ok":
                    raise SystemExit(f"the oracle failed on {p!r}: {o.cause}")
                out[p] = o.tokens
        return out
    finally:
        proc.terminate()  # SIGTERM: the same clean stop as SIGINT, without KeyboardInterrupt's slow exit
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- one request ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    prompt: str
    start: float
    end: float
    status: str  # ok | error | hang | cut (the client closed the stream on purpose)
    cause: str = ""  # error: the error body's code (else its message), or what the client saw
    tokens: list[str] = field(default_factory=list)
    verdict: str = ""  # correct | silent | failed_named | failed_unnamed | hang | cut
    http_status: int | None = None  # of the answer's head (a stream's error event: 200)
    retry_after: str | None = None  # its Retry-After header, if it had one

    @property
    def rejected(self) -> bool:
        """Turned away for load: a 429, a 503 whose cause says overloaded, or any answer that
        tells the client when to come back."""
        return self.status == "error" and (
            self.http_status == 429
            or (self.http_status == 503 and "overload" in self.cause)
            or self.retry_after is not None
        )


def _cause(r: httpx.Response | dict) -> str:
    body = r if isinstance(r, dict) else None
    if body is None:
        try:
            body = r.json()
        except ValueError:
            return ""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return ""
    return str(err.get("code") or err.get("message") or "")


def request(
    client: httpx.Client,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    bound_s: float,
    cut_after: int = 0,
) -> Outcome:
    """One greedy completion with per-token logprobs (the tokens the oracle compares: each
    output id decoded alone, so equal lists mean equal ids up to tokens decoding alike).
    cut_after > 0: streamed, and the client closes the stream after that many chunks with tokens."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 0,
        "stream": cut_after > 0,
    }
    t0 = time.monotonic()

    def done(
        status: str,
        cause: str = "",
        tokens: list[str] | None = None,
        r: httpx.Response | None = None,
    ) -> Outcome:
        o = Outcome(prompt, t0, time.monotonic(), status, cause, tokens or [])
        if r is not None:
            o.http_status, o.retry_after = r.status_code, r.headers.get("retry-after")
        return o

    try:
        if cut_after <= 0:
            r = client.post(url + "/v1/completions", json=body)
            if r.status_code != 200:
                return done("error", _cause(r) or f"HTTP {r.status_code} without a cause", r=r)
            ch = r.json()["choices"][0]
            toks = list((ch.get("logprobs") or {}).get("tokens") or [])
            return done("ok", tokens=toks)
        toks: list[str] = []
        chunks = 0
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return done("error", _cause(r) or f"HTTP {r.status_code} without a cause", r=r)
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return done("ok", tokens=toks)
                ev = json.loads(data)
                if "error" in ev:
                    return done("error", _cause(ev) or "error event without a cause")
                ch = ev["choices"][0]
                toks += (ch.get("logprobs") or {}).get("tokens") or []
                chunks += bool(ch.get("logprobs"))
                if chunks >= cut_after:
                    return done("cut", tokens=toks)  # leaving the block closes the connection
        return done("error", "stream ended without [DONE]")
    except httpx.TimeoutException as e:
        return done("hang", f"no answer within {bound_s:g}s ({type(e).__name__})")
    except httpx.HTTPError as e:
        return done("error", f"client: {type(e).__name__}")


def judge(o: Outcome, oracle: dict[str, list[str]]) -> Outcome:
    if o.status == "ok":
        o.verdict = "correct" if o.tokens == oracle[o.prompt] else "silent"
    elif o.status == "error":
        # A named cause is the server's; the client's own view (reset, no [DONE]) is not one.
        unnamed = not o.cause or o.cause.startswith(("client:", "stream ended", "HTTP "))
        o.verdict = "failed_unnamed" if unnamed else "failed_named"
    elif o.status == "cut":
        # What came before the cut must already be the oracle's beginning.
        ok = o.tokens == oracle[o.prompt][: len(o.tokens)]
        o.verdict = "cut" if ok else "silent"
    else:
        o.verdict = o.status
    return o


class Load:
    """`concurrency` threads, each sending one request after another (prompts in turn) until
    stopped; every outcome judged against the oracle."""

    def __init__(
        self,
        url: str,
        args: argparse.Namespace,
        oracle: dict,
        cut_after: int = 0,
        concurrency: int = 0,
    ) -> None:
        self.url, self.args, self.oracle, self.cut_after = url, args, oracle, cut_after
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._worker, args=(i,), daemon=True)
            for i in range(concurrency or args.concurrency)
        ]
        for t in self._threads:
            t.start()

    def _worker(self, i: int) -> None:
        a = self.args
        with httpx.Client(timeout=httpx.Timeout(a.request_bound, connect=10.0)) as client:
            n = i
            while not self._stop.is_set():
                p = PROMPTS[n % len(PROMPTS)]
                o = judge(
                    request(
                        client, self.url, a.model, p, a.max_tokens, a.request_bound, self.cut_after
                    ),
                    self.oracle,
                )
                n += 1
                with self._lock:
                    self.outcomes.append(o)
                if o.status == "error":
                    time.sleep(0.2)  # a down stack answers at once: do not spin

    def count(self, pred) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if pred(o))

    def since(self, t: float) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.start >= t]

    def stop(self) -> list[Outcome]:
        """Every request in flight ends (each within the bound) before this returns."""
        self._stop.set()
        for t in self._threads:
            t.join()
        return self.outcomes


def held_when_idle(urls: dict[str, str], timeout_s: float) -> dict:
    """The idle gauges of each server, polled until all read 0 or `timeout_s` passes: what is
    still held then (must be nothing) and how long it took to drain."""
    t0 = time.monotonic()
    held: dict[str, dict[str, float]] = {}
    while True:
        held = {}
        for name, url in urls.items():
            try:
                text = httpx.get(url + "/metrics", timeout=5).text
            except httpx.HTTPError as e:
                held[name] = {f"unreachable ({type(e).__name__})": 1.0}
                continue
            vals = {m[1] + (m[2] or ""): float(m[3]) for m in IDLE_GAUGES.finditer(text)}
            if not any(k.startswith("kvrelay_kv_pages_used") for k in vals):
                held[name] = {"kvrelay_kv_pages_used missing": 1.0}
                continue
            nonzero = {k: v for k, v in vals.items() if v}
            if nonzero:
                held[name] = nonzero
        if not held or time.monotonic() - t0 > timeout_s:
            return {"held": held, "drain_s": round(time.monotonic() - t0, 1)}
        time.sleep(0.5)


ROUTER_COUNTERS = re.compile(
    r'^kvrelay_router_(failures_total\{cause="([^"]+)"\}|client_disconnects_total|retries_total)'
    r" ([0-9.e+-]+)$",
    re.M,
)


def router_gauge(url: str, name: str = "kvrelay_router_inflight_requests") -> float | None:
    """One gauge of the router's /metrics (default: its requests in flight); None when it has no
    such gauge or does not answer."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m[1]) if m else None


class GaugePeak:
    """Polls a router gauge in a thread while load runs; keeps the highest value read."""

    def __init__(self, url: str, interval_s: float = 0.25) -> None:
        self.url, self.interval_s = url, interval_s
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            v = router_gauge(self.url)
            if v is not None:
                self.peak = v if self.peak is None else max(self.peak, v)
            self._stop.wait(self.interval_s)

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join()
        return self.peak


def router_counters(url: str) -> Counter:
    """The router's failed attempts by cause (a retried attempt counts too: each is one fault the
    stack detected), its retries and the client disconnects it saw."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out: Counter = Counter()
    for m in ROUTER_COUNTERS.finditer(text):
        out[m[2] or m[1].removesuffix("_total")] = int(float(m[3]))
    return out
