"""Benchmark statistics as pure functions: percentiles, per-request latencies, throughput, goodput,
and deltas of a server's Prometheus counters."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

SLO_KEYS = ("ttft", "tpot", "e2el")
NUM_ERROR_EXAMPLES = 5  # failures kept word for word per level (the first ones)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; `start` is relative to the level start."""

    session: str = ""
    turn: int = 0
    start: float = 0.0
    success: bool = False
    error: str | None = None  # what went wrong, in words: the server's message where it sent one
    # Failure class: the HTTP status ("429"), "stream_error" (an SSE error event), "timeout",
    # "no_done", "no_tokens" or "exception:<type>" (what the client raised); None on success.
    cause: str | None = None
    ttft: float | None = None  # send -> first chunk carrying a choice
    itl: list[float] = field(default_factory=list)  # gaps between successive choice chunks
    e2e: float | None = None  # send -> end of stream
    prompt_tokens: int = 0  # from the server's usage (the real length, not the target)
    cached_tokens: int = 0  # of them, found in the server's prefix cache (not computed)
    output_tokens: int = 0
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1): undefined for fewer than two tokens."""
        if not self.success or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    xs = sorted(values)
    h = (len(xs) - 1) * q / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def summarize(
    values: Sequence[float], percentiles: Iterable[float] = (50, 90, 99), scale: float = 1.0
) -> dict:
    """count, mean, std (population), min, max and pNN of `values` times `scale`; None when empty."""
    pcts = list(percentiles)
    xs = [v * scale for v in values]
    out: dict = {"count": len(xs)}
    keys = ["mean", "std", "min", "max"] + [percentile_key(p) for p in pcts]
    if not xs:
        return out | dict.fromkeys(keys)
    mean = sum(xs) / len(xs)
    out |= {
        "mean": mean,
        "std": math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)),
        "min": min(xs),
        "max": max(xs),
    }
    for p in pcts:
        out[percentile_key(p)] = percentile(xs, p)
    return out


def percentile_key(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=200,tpot=50' (or vLLM's 'ttft:200 tpot:50'), milliseconds -> {'ttft': 200.0, ...}."""
    slo: dict[str, float] = {}
    for part in re.split(r"[,\s]+", text.strip()):
        if not part:
            continue
        m = re.fullmatch(r"([A-Za-z][A-Za-z0-9_]*)[=:](.+)", part)
        if not m:
            raise ValueError(f"SLO {part!r} is not KEY=MILLISECONDS")
        key, value = m.groups()
        key = key.strip().lower()
        if key not in SLO_KEYS:
            raise ValueError(f"unknown SLO {key!r}; use {', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO {key}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"SLO {key} must be a positive number of milliseconds")
        slo[key] = ms
    return slo


def meets_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    """A successful request within every bound (ms). A request with no TPOT (one token) passes TPOT,
    as in vLLM's goodput."""
    if not r.success:
        return False
    measured = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
    return all(measured[k] is not None and measured[k] * 1e3 <= bound for k, bound in slo.items())


def level_summary(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: dict[str, float] | None = None,
    percentiles: Iterable[float] = (50, 90, 99),
) -> dict:
    """Everything reported for one load level. Latencies in ms; throughputs per second of the
    level's wall time (first send to last completion)."""
    pcts = list(percentiles)
    ok = [r for r in records if r.success]
    dur = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    good = [r for r in ok if meets_slo(r, slo)] if slo else ok
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        # Prefix cache: prompt tokens served from it, and the prompt tokens prefilled.
        "total_cached_tokens": cached,
        "prefill_tokens_computed": in_tokens - cached,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        # sglang's "Concurrency": time-average of requests in flight, as the client saw it.
        "mean_concurrency": sum(r.e2e for r in ok if r.e2e is not None) / dur,
        "good_requests": len(good),
        "goodput": len(good) / dur,
        "input_tokens": summarize([r.prompt_tokens for r in ok], ()),
        "output_tokens": summarize([r.output_tokens for r in ok], ()),
        "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None], pcts, 1e3),
        "tpot_ms": summarize([t for r in ok if (t := r.tpot) is not None], pcts, 1e3),
        "itl_ms": summarize([g for r in ok for g in r.itl], pcts, 1e3),
        "e2el_ms": summarize([r.e2e for r in ok if r.e2e is not None], pcts, 1e3),
        "finish_reasons": _count(r.finish_reason or "none" for r in ok),
        "errors": group_errors([r.error or "unknown error" for r in records if not r.success]),
        **failure_report(
            [
                (r.cause, r.error, {"session": r.session, "turn": r.turn, "start_s": r.start})
                for r in sorted(records, key=lambda r: r.start)
                if not r.success
            ]
        ),
    }


def failure_report(
    failures: Sequence[tuple[str | None, str | None, dict]], num_examples: int = NUM_ERROR_EXAMPLES
) -> dict:
    """Why requests failed: `failure_causes`, a histogram of their classes (HTTP status,
    stream_error, exception:<type>, ...), most frequent first; and `error_examples`, the first
    `num_examples` failures word for word (cause, error, and the given context)."""
    causes = _count(c or "unknown" for c, _, _ in failures)
    return {
        "failure_causes": dict(sorted(causes.items(), key=lambda kv: -kv[1])),
        "error_examples": [
            {"cause": c or "unknown", "error": e or "unknown error", **where}
            for c, e, where in failures[:num_examples]
        ],
    }


def merge_causes(histograms: Iterable[dict[str, int]]) -> dict[str, int]:
    """The sum of several failure histograms, most frequent first."""
    out: dict[str, int] = {}
    for h in histograms:
        for k, n in h.items():
            out[k] = out.get(k, 0) + n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def describe_causes(causes: dict[str, int]) -> str:
    """'429 3, stream_error 1' (most frequent first)."""
    return ", ".join(f"{k} {n}" for k, n in causes.items())


def group_errors(errors: Iterable[str]) -> list[dict]:
    """Errors that differ only in numbers (lengths, ids) as one entry: an example and a count,
    most frequent first."""
    groups: dict[str, dict] = {}
    for e in errors:
        g = groups.setdefault(error_kind(e), {"error": e, "count": 0})
        g["count"] += 1
    return sorted(groups.values(), key=lambda g: -g["count"])


def error_kind(error: str) -> str:
    """An error message with its numbers blanked: messages of one kind compare equal."""
    return re.sub(r"\d+", "#", error)


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


# --- the server's own counters ------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_prometheus(text: str) -> Samples:
    """Prometheus text exposition -> {metric name: [(labels, value), ...]}; a declared counter or
    gauge without samples maps to []."""
    out: Samples = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            # A labelled counter exports no sample until a label set is used: declared means zero.
            parts = line.split()
            if len(parts) == 4 and parts[3] in ("counter", "gauge"):
                out.setdefault(parts[2], [])
            continue
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def metric_total(s: Samples, name: str) -> float | None:
    """Sum over all label sets; None when the server does not export the metric."""
    return sum(v for _, v in s[name]) if name in s else None


def server_delta(before: Samples, after: Samples) -> dict:
    """What a kvrelay server counted between two scrapes (None for metrics it does not export)."""

    def d(name: str) -> float | None:
        a, b = metric_total(after, name), metric_total(before, name)
        return None if a is None or b is None else a - b

    by_reason: dict[str, float] = {}
    for labels, v in after.get("kvrelay_requests_total", []):
        key = labels.get("finish_reason", "")
        prev = sum(x for lb, x in before.get("kvrelay_requests_total", []) if lb == labels)
        if v - prev:
            by_reason[key] = by_reason.get(key, 0.0) + v - prev
    steps, step_s = d("kvrelay_engine_step_seconds_count"), d("kvrelay_engine_step_seconds_sum")
    drafts = d("kvrelay_spec_decode_num_drafts_total")
    accepted = d("kvrelay_spec_decode_num_accepted_tokens_total")
    return {
        "requests": d("kvrelay_requests_total"),
        "requests_by_finish_reason": by_reason,
        "generation_tokens": d("kvrelay_generation_tokens_total"),
        "prompt_tokens": d("kvrelay_prompt_tokens_total"),
        "request_errors": d("kvrelay_request_errors_total"),
        "prefix_cache_query_tokens": d("kvrelay_prefix_cache_query_tokens_total"),
        "prefix_cache_hit_tokens": d("kvrelay_prefix_cache_hit_tokens_total"),
        "prefix_cache_evicted_pages": d("kvrelay_prefix_cache_evicted_pages_total"),
        "engine_steps": steps,
        "engine_step_mean_ms": step_s / steps * 1e3 if steps and step_s is not None else None,
        # Speculative decoding: tokens a verify step emitted per request, on average (1 + the
        # accepted drafts); None where the server does not speculate or verified nothing.
        "spec_decode_draft_tokens": d("kvrelay_spec_decode_num_draft_tokens_total"),
        "spec_decode_accepted_tokens": accepted,
        "spec_decode_mean_accepted_length": 1 + accepted / drafts
        if drafts and accepted is not None
        else None,
    }
