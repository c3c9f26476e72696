"""The load generator: streams requests to an OpenAI-compatible server over HTTP and times every
chunk; runs closed-loop concurrency levels and open-loop (Poisson/gamma) request-rate levels;
brackets each level with scrapes of the server's /metrics so its counters can be checked; and reads
the engine steps each level caused (/telemetry/steps) to fit the step-time model."""

from __future__ import annotations

import asyncio
import json
import math
import platform
import random
import socket
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import httpx

from kvrelay.bench import metrics as bm
from kvrelay.bench import stepfit, stepsplit
from kvrelay.bench.metrics import RequestRecord
from kvrelay.bench.workloads import (
    CHAT,
    AgentSession,
    RequestSpec,
    Response,
    Session,
    TextCalibration,
    WorkloadConfig,
    build_sessions,
    random_text,
)
from kvrelay.config import api_key_headers

SCHEMA_VERSION = 1
PROBE_WORDS = (16, 160)  # two prompt sizes: their token counts give tokens/word and the offset


class BenchError(Exception):
    """The benchmark cannot run (server unreachable, probe rejected, bad configuration)."""


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    workload: WorkloadConfig
    model: str | None = None  # None: the first model the server lists
    concurrency: tuple[int, ...] = ()  # closed-loop levels
    request_rates: tuple[float, ...] = ()  # open-loop levels, requests/s (inf: all at once)
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1 is Poisson
    max_concurrency: int | None = None  # open loop: cap on requests in flight
    num_prompts: int | None = None  # requests per level; None: see requests_for()
    num_warmups: int = 1
    seed: int = 0
    slo: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = (50, 90, 99)
    request_timeout_s: float = 600.0
    metrics_interval_s: float = 0.5  # polling of server gauges during a level; 0 disables
    save_detailed: bool = False
    # Ask the server to split every N-th step into components during the run (then restore);
    # None: leave the server's setting alone.
    step_profile_every: int | None = None

    def __post_init__(self) -> None:
        if bool(self.concurrency) == bool(self.request_rates):
            raise BenchError(
                "give either concurrency levels (closed loop) or request rates (open loop)"
            )
        if any(c < 1 for c in self.concurrency):
            raise BenchError("concurrency levels must be at least 1")
        if any(not r > 0 for r in self.request_rates):
            raise BenchError("request rates must be positive (inf: all at once)")
        if not self.burstiness > 0:
            raise BenchError("burstiness must be positive")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise BenchError("num_prompts must be at least 1")
        if self.num_warmups < 0:
            raise BenchError("num_warmups must not be negative")
        if not self.percentiles or any(not 0 <= p <= 100 for p in self.percentiles):
            raise BenchError("percentiles must be between 0 and 100")
        if not self.request_timeout_s > 0:
            raise BenchError("request_timeout_s must be positive")
        if self.step_profile_every is not None and self.step_profile_every < 0:
            raise BenchError("step_profile_every must not be negative")

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency else "open"

    def levels(self) -> list[float]:
        return list(self.concurrency or self.request_rates)

    def requests_for(self, level: float) -> int:
        """Per level: --num-prompts, else 5x the concurrency (steady state, as sglang advises; at
        least 16) in closed loop and 64 in open loop."""
        if self.num_prompts is not None:
            return self.num_prompts
        return max(16, 5 * int(level)) if self.mode == "closed" else 64


class Progress:
    """Callbacks the CLI turns into a progress bar; the default does nothing."""

    def start_level(self, label: str, total: int) -> None: ...

    def request_done(self, record: RequestRecord) -> None: ...

    def end_level(self) -> None: ...


# --- one request --------------------------------------------------------------------------------


async def stream_request(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    spec: RequestSpec,
    timeout_s: float,
    t0: float,
) -> tuple[RequestRecord, Response]:
    """Send one streaming request; time every chunk that carries a choice."""
    body = spec.body | {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    rec = RequestRecord(start=start - t0)
    resp = Response()
    calls: dict[int, dict] = {}
    usage: dict | None = None
    chunks, last, done = 0, start, False
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", base_url + spec.endpoint, json=body) as r:
                if r.status_code != 200:
                    rec.cause = str(r.status_code)
                    rec.error = http_error(r.status_code, await r.aread(), r.headers)
                    return rec, resp
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if "error" in obj:
                        rec.cause, rec.error = "stream_error", stream_error(obj)
                        return rec, resp
                    if obj.get("usage"):
                        usage = obj["usage"]
                    choices = obj.get("choices") or []
                    if not choices:
                        continue
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    _absorb(choices[0], resp, calls)
    except TimeoutError:
        rec.cause, rec.error = "timeout", f"timeout after {timeout_s:g}s"
        return rec, resp
    # httpx's own (connect, read, protocol, pool), a chunk that is not JSON or not shaped like one
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as e:
        rec.cause, rec.error = f"exception:{type(e).__name__}", f"{type(e).__name__}: {e}"
        return rec, resp
    rec.e2e = time.perf_counter() - start
    if not done:
        rec.cause, rec.error = "no_done", "stream ended without [DONE]"
        return rec, resp
    rec.success = rec.ttft is not None
    if not rec.success:
        rec.cause, rec.error = "no_tokens", "no tokens streamed"
    rec.prompt_tokens = int((usage or {}).get("prompt_tokens", 0))
    rec.cached_tokens = int(
        ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    )
    # The server's count is the truth (a chunk may carry several tokens, or none after a stop).
    rec.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    rec.finish_reason = resp.finish_reason
    resp.tool_calls = [calls[i] for i in sorted(calls)]
    return rec, resp


def _absorb(choice: dict, resp: Response, calls: dict[int, dict]) -> None:
    """Fold one streamed choice into the response: text, tool-call fragments, finish reason."""
    delta = choice.get("delta")
    if delta is None:  # /v1/completions
        resp.text += choice.get("text") or ""
    else:
        resp.text += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            c = calls.setdefault(
                tc.get("index", len(calls)),
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            c["id"] = tc.get("id") or c["id"]
            fn = tc.get("function") or {}
            c["function"]["name"] += fn.get("name") or ""
            c["function"]["arguments"] += fn.get("arguments") or ""
    resp.finish_reason = choice.get("finish_reason") or resp.finish_reason


def error_fields(raw: bytes | dict) -> tuple[str | None, str]:
    """The code and message of an OpenAI error body (`{"error": {"message", "code", ...}}`);
    of anything else: no code, and its first 200 characters."""
    obj = raw
    if not isinstance(raw, dict):
        try:
            obj = json.loads(raw)
        except ValueError:
            return None, raw[:200].decode(errors="replace")
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        return (str(code) if code else None), str(err.get("message") or json.dumps(err))
    if isinstance(err, str):
        return None, err
    return None, json.dumps(obj)[:200]


def http_error(status: int, raw: bytes, headers: httpx.Headers | None = None) -> str:
    """'HTTP 429 overloaded (Retry-After 1): <message>': the status, the body's code, the
    Retry-After header when there is one, and the body's message."""
    code, message = error_fields(raw)
    head = f"HTTP {status}" + (f" {code}" if code else "")
    retry = headers.get("retry-after") if headers is not None else None
    if retry is not None:
        head += f" (Retry-After {retry})"
    return f"{head}: {message or '(empty body)'}"


def stream_error(event: dict) -> str:
    """An SSE error event (a stream that had begun, so its status was already 200)."""
    code, message = error_fields(event)
    return "stream error" + (f" {code}" if code else "") + f": {message}"


# --- sessions under load ------------------------------------------------------------------------

Send = Callable[[RequestSpec], Awaitable[tuple[RequestRecord, Response]]]


async def run_session(
    session: Session,
    send: Send,
    records: list[RequestRecord],
    progress: Progress,
    limit: asyncio.Semaphore | None = None,
) -> None:
    """All turns of a session in order; a failed turn ends it (its history would be broken)."""
    while (spec := session.next_request()) is not None:
        if limit is None:
            rec, resp = await send(spec)
        else:
            async with limit:
                rec, resp = await send(spec)
        rec.session, rec.turn = session.session_id, session.turn
        records.append(rec)
        progress.request_done(rec)
        if not rec.success:
            return
        session.record(resp)


async def run_closed(
    sessions: list[Session],
    concurrency: int,
    send: Send,
    records: list[RequestRecord],
    progress: Progress,
) -> None:
    """`concurrency` users, each starting its next session as soon as the last one ends."""
    queue = deque(sessions)

    async def user() -> None:
        while queue:
            await run_session(queue.popleft(), send, records, progress)

    await asyncio.gather(*(user() for _ in range(min(concurrency, len(sessions)))))


async def run_open(
    sessions: list[Session],
    rate: float,
    burstiness: float,
    rng: random.Random,
    send: Send,
    records: list[RequestRecord],
    progress: Progress,
    max_concurrency: int | None = None,
) -> None:
    """Sessions arrive at `rate` per second with gamma(burstiness) gaps (Poisson at 1), whatever
    the server's state; a session's later turns follow its earlier ones at once."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0, at, tasks = time.perf_counter(), 0.0, []
    for i, s in enumerate(sessions):
        if i and math.isfinite(rate):
            at += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(run_session(s, send, records, progress, limit)))
    await asyncio.gather(*tasks)


# --- the server -------------------------------------------------------------------------------------


async def scrape(client: httpx.AsyncClient, base_url: str) -> bm.Samples | None:
    """The server's /metrics, or None if it has none."""
    try:
        r = await client.get(base_url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    return bm.parse_prometheus(r.text) if r.status_code == 200 else None


async def steps_since(client: httpx.AsyncClient, base_url: str, seq: int | None) -> dict | None:
    """The server's step telemetry from `seq` on (None: only the cursor, as `head`); None if the
    server keeps none."""
    params = {"limit": 0} if seq is None else {"since": seq}
    try:
        r = await client.get(base_url + "/telemetry/steps", params=params, timeout=30)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def set_step_profile(client: httpx.AsyncClient, base_url: str, every: int) -> int:
    """Tell the server to profile every N-th step; returns its previous setting."""
    try:
        r = await client.post(base_url + "/telemetry/profile", json={"every": every}, timeout=10)
        r.raise_for_status()
        return r.json()["previous"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise BenchError(
            f"the server cannot profile its steps (POST /telemetry/profile): {e}"
        ) from e


async def resolve_model(client: httpx.AsyncClient, base_url: str) -> str:
    try:
        r = await client.get(base_url + "/v1/models", timeout=10)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise BenchError(f"cannot list models at {base_url}/v1/models: {e}") from None


async def calibrate(
    client: httpx.AsyncClient, base_url: str, model: str, endpoint: str, seed: int
) -> tuple[TextCalibration, dict]:
    """Two non-streaming probes of different word counts; their prompt_tokens fit the line
    tokens = offset + tokens_per_word * words. Returns it and the probes' usage totals."""
    rng = random.Random(f"calibrate/{seed}")
    counts, totals = [], {"requests": 0, "prompt_tokens": 0, "output_tokens": 0}
    for words in PROBE_WORDS:
        text = random_text(rng, words, TextCalibration())
        body = {"model": model, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
        body |= (
            {"messages": [{"role": "user", "content": text}]}
            if endpoint == CHAT
            else {"prompt": text}
        )
        try:
            r = await client.post(base_url + endpoint, json=body, timeout=120)
        except httpx.HTTPError as e:
            raise BenchError(f"calibration probe failed: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise BenchError(
                f"calibration probe rejected: {http_error(r.status_code, r.content, r.headers)}"
            )
        try:
            usage = r.json().get("usage") or {}
        except (ValueError, AttributeError):
            raise BenchError(
                f"calibration probe: the response is not a JSON object: {r.text[:200]!r}"
            ) from None
        if "prompt_tokens" not in usage:
            raise BenchError(
                "the server's response has no usage.prompt_tokens; cannot size prompts"
            )
        counts.append(usage["prompt_tokens"])
        totals["requests"] += 1
        totals["prompt_tokens"] += usage["prompt_tokens"]
        totals["output_tokens"] += usage.get("completion_tokens", 0)
    (w1, w2), (t1, t2) = PROBE_WORDS, counts
    per_word = max((t2 - t1) / (w2 - w1), 0.05)
    return TextCalibration(tokens_per_word=per_word, offset=max(t1 - per_word * w1, 0.0)), totals


class GaugePeaks:
    """Polls the server's gauges during a level and keeps their peaks."""

    NAMES = (
        "kvrelay_num_requests_running",
        "kvrelay_num_requests_waiting",
        "kvrelay_kv_pages_used",
    )

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}

    async def poll(self, client: httpx.AsyncClient, base_url: str, interval_s: float) -> None:
        while True:
            s = await scrape(client, base_url)
            if s is None:
                return
            for name in self.NAMES:
                v = bm.metric_total(s, name)
                if v is not None:
                    key = name.removeprefix("kvrelay_")
                    self.peaks[key] = max(self.peaks.get(key, v), v)
            await asyncio.sleep(interval_s)


# --- the sweep ----------------------------------------------------------------------------------


async def run_sweep(cfg: BenchConfig, progress: Progress | None = None) -> dict:
    """Calibrate, warm up, run every level; return the JSON-ready result."""
    progress = progress or Progress()
    wl = cfg.workload
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: a proxy from the environment must not sit between bench and server.
    async with httpx.AsyncClient(
        limits=limits,
        timeout=httpx.Timeout(cfg.request_timeout_s, connect=10),
        trust_env=False,
        headers=api_key_headers(),
    ) as client:
        base = cfg.base_url.rstrip("/")
        model = cfg.model or await resolve_model(client, base)
        cal, preamble = await calibrate(client, base, model, wl.endpoint, cfg.seed)
        if cfg.num_warmups:
            await _warm_up(client, base, model, cfg, cal, preamble)
        levels, steps = [], []
        restore = None
        if cfg.step_profile_every is not None:
            restore = await set_step_profile(client, base, cfg.step_profile_every)
        try:
            for i, level in enumerate(cfg.levels()):
                out, lv_steps = await _run_level(client, base, model, cfg, cal, i, level, progress)
                levels.append(out)
                steps.append(lv_steps)
        finally:
            if restore is not None:
                await set_step_profile(client, base, restore)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "kvrelay.bench",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "base_url": cfg.base_url,
        "model": model,
        "config": _config_dict(cfg),
        "calibration": {
            "tokens_per_word": cal.tokens_per_word,
            "offset_tokens": cal.offset,
            "probe_words": list(PROBE_WORDS),
        },
        "preamble": preamble,
        "environment": _environment(),
        "levels": levels,
        "totals": _totals(levels),
        # Across all levels (each weighing the same): a sweep spans batch sizes one level cannot.
        "step_fit": stepfit.fit_step_time(steps) if any(steps) else None,
        "step_split": stepsplit.component_split(steps) if any(steps) else None,
    }


async def _warm_up(
    client: httpx.AsyncClient,
    base: str,
    model: str,
    cfg: BenchConfig,
    cal: TextCalibration,
    preamble: dict,
) -> None:
    """Short random requests before the first level (first-call costs: allocation, compilation)."""
    wl = WorkloadConfig(
        dataset="random",
        endpoint=cfg.workload.endpoint,
        input_len=min(cfg.workload.input_len, 256),
        output_len=min(cfg.workload.output_len, 16),
        ignore_eos=True,
    )
    sessions = build_sessions(wl, cfg.num_warmups, cfg.seed - 1, cal)
    records: list[RequestRecord] = []
    send = lambda spec: stream_request(
        client, base, model, spec, cfg.request_timeout_s, time.perf_counter()
    )
    await run_closed(sessions, min(cfg.num_warmups, 8), send, records, Progress())
    bad = [r for r in records if not r.success]
    if bad:
        raise BenchError(f"warm-up request failed: {bad[0].error}")
    preamble["requests"] += len(records)
    preamble["prompt_tokens"] += sum(r.prompt_tokens for r in records)
    preamble["output_tokens"] += sum(r.output_tokens for r in records)


async def _run_level(
    client: httpx.AsyncClient,
    base: str,
    model: str,
    cfg: BenchConfig,
    cal: TextCalibration,
    index: int,
    level: float,
    progress: Progress,
) -> tuple[dict, list[dict]]:
    """The level's JSON and the engine steps it caused (empty if the server keeps none)."""
    # A fresh seed per level: a prefix cache must not serve one level from the previous one's prompts.
    seed = cfg.seed + 1000 * (index + 1)
    sessions = build_sessions(cfg.workload, cfg.requests_for(level), seed, cal)
    total = sum(s.num_turns for s in sessions)
    label = f"concurrency {int(level)}" if cfg.mode == "closed" else f"rate {level:g}/s"
    records: list[RequestRecord] = []
    before = await scrape(client, base)
    cursor = await steps_since(client, base, None)
    peaks = GaugePeaks()
    poller = (
        asyncio.create_task(peaks.poll(client, base, cfg.metrics_interval_s))
        if before is not None and cfg.metrics_interval_s > 0
        else None
    )
    progress.start_level(label, total)
    t0 = time.perf_counter()
    send = lambda spec: stream_request(client, base, model, spec, cfg.request_timeout_s, t0)
    try:
        if cfg.mode == "closed":
            await run_closed(sessions, int(level), send, records, progress)
        else:
            rng = random.Random(f"arrivals/{seed}")
            await run_open(
                sessions, level, cfg.burstiness, rng, send, records, progress, cfg.max_concurrency
            )
        duration = time.perf_counter() - t0  # first send to last completion
    finally:
        progress.end_level()
        if poller is not None:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
    after = await scrape(client, base)
    telemetry = None if cursor is None else await steps_since(client, base, cursor["head"])
    steps = telemetry["steps"] if telemetry else []
    out = {
        "mode": cfg.mode,
        "concurrency": int(level) if cfg.mode == "closed" else cfg.max_concurrency,
        "request_rate": None
        if cfg.mode == "closed"
        else (level if math.isfinite(level) else "inf"),
        "label": label,
        "seed": seed,
        "num_sessions": len(sessions),
    }
    out |= bm.level_summary(records, duration, cfg.slo or None, cfg.percentiles)
    out["server"] = (
        bm.server_delta(before, after) if before is not None and after is not None else None
    )
    out["server_peaks"] = peaks.peaks or None
    out["counters_agree"] = _agree(out)
    agents = [s for s in sessions if isinstance(s, AgentSession)]
    if agents:
        out["tool_calls"] = {
            "model": sum(s.model_tool_calls for s in agents),
            "scripted": sum(s.scripted_tool_calls for s in agents),
        }
    out["step_fit"] = stepfit.fit_step_time(steps)
    out["step_split"] = stepsplit.component_split(steps)
    out["steps_dropped"] = telemetry["dropped"] if telemetry else None
    if cfg.save_detailed:
        out["requests"] = [_detail(r) for r in records]
        out["steps"] = steps
    return out, steps


def _agree(level: dict) -> bool | None:
    """Did the server count exactly the requests and tokens this level completed? None: no counters."""
    s = level.get("server")
    keys = ("requests", "generation_tokens", "prompt_tokens")
    if not s or any(s.get(k) is None for k in keys):
        return None
    return (
        s["requests"] == level["completed"]
        and s["generation_tokens"] == level["total_output_tokens"]
        and s["prompt_tokens"] == level["total_input_tokens"]
    )


def _detail(r: RequestRecord) -> dict:
    ms = lambda x: None if x is None else x * 1e3
    return {
        "session": r.session,
        "turn": r.turn,
        "start_s": r.start,
        "success": r.success,
        "cause": r.cause,
        "error": r.error,
        "ttft_ms": ms(r.ttft),
        "tpot_ms": ms(r.tpot),
        "e2el_ms": ms(r.e2e),
        "itl_ms": [g * 1e3 for g in r.itl],
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "output_tokens": r.output_tokens,
        "finish_reason": r.finish_reason,
    }


def _totals(levels: list[dict]) -> dict:
    servers = [lv["server"] for lv in levels]
    known = all(s and s.get("requests") is not None for s in servers)
    agree = [lv["counters_agree"] for lv in levels]
    return {
        "requests": sum(lv["num_requests"] for lv in levels),
        "completed": sum(lv["completed"] for lv in levels),
        "failed": sum(lv["failed"] for lv in levels),
        "failure_causes": bm.merge_causes(lv["failure_causes"] for lv in levels),
        "output_tokens": sum(lv["total_output_tokens"] for lv in levels),
        "input_tokens": sum(lv["total_input_tokens"] for lv in levels),
        "server_requests": sum(s["requests"] for s in servers) if known else None,
        "server_generation_tokens": sum(s["generation_tokens"] or 0 for s in servers)
        if known
        else None,
        "counters_agree": None if None in agree else all(agree),
    }


def _config_dict(cfg: BenchConfig) -> dict:
    d = asdict(cfg)
    d["mode"] = cfg.mode
    d["request_rates"] = [r if math.isfinite(r) else "inf" for r in cfg.request_rates]
    d["levels"] = [cfg.requests_for(lv) for lv in cfg.levels()]
    d["requests_per_level"] = d.pop("levels")
    return d


def _environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        kv = version("kvrelay")
    except PackageNotFoundError:
        kv = None
    return {
        "kvrelay": kv,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "argv": sys.argv,
    }
