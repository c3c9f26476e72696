"""A server's load as the router balances it: the requests this router has in flight to it,
combined with what the server last reported of itself (`GET /load`, read by the probe), which
also covers what other routers and direct clients sent it.

load = max(in flight from this router, reported requests) + queued prompt tokens / 1024
- The two request counts overlap (this router's requests are among those the server reports), so
  the larger counts, never the sum: the router's own count is exact and immediate (a burst it
  just sent shows before the next probe), the report covers everyone else's and lags by at most
  a probe. The reported requests are max(running + waiting, requests the API holds open): a PD
  decode server's requests waiting for their KV are in the second, not in the engine's counts.
- Queued prompt tokens (prompts not yet prefilled) weigh long prompts: every
  QUEUED_TOKENS_PER_REQUEST of them count as one request more (a 30k-token prompt waiting makes
  a prefill server busier than a few short ones).
- A server whose KV pool is nearly full (free pages below FULL_FREE_FRACTION of its pool) is
  loaded whatever its count: the policy prefers any server that is not (policy.py).
- A report older than `stale_after_s` (a few probe intervals: the server stopped answering) is
  ignored: the load is then this router's in-flight count alone, as with no report.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

QUEUED_TOKENS_PER_REQUEST = 1024  # queued prompt tokens that weigh as one request in flight
FULL_FREE_FRACTION = 0.05  # free KV pages below this share of the pool: nearly full
STALE_PROBES = 3  # a report older than this many probe intervals (plus a probe's timeout) is stale


@dataclass(frozen=True)
class ReportedLoad:
    running: int
    waiting: int
    requests: int
    queued_prompt_tokens: int
    free_pages: int
    total_pages: int
    at: float  # time.monotonic() when the router received it

    @classmethod
    def parse(cls, d: object, at: float) -> ReportedLoad:
        """From a server's `/load` JSON; ValueError when a field is missing or not a count."""
        if not isinstance(d, dict):
            raise ValueError(f"a load report is a JSON object, not {type(d).__name__}")
        counts = {}
        for f in fields(cls):
            if f.name == "at":
                continue
            v = d.get(f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"load report field {f.name!r} is {v!r}, not a count")
            counts[f.name] = v
        return cls(**counts, at=at)

    @property
    def requests_in_flight(self) -> int:
        return max(self.running + self.waiting, self.requests)

    @property
    def nearly_full(self) -> bool:
        return self.total_pages > 0 and self.free_pages < FULL_FREE_FRACTION * self.total_pages

    def as_dict(self, now: float) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "at"}
        return {**d, "age_s": round(now - self.at, 3)}


def server_load(inflight: int, report: ReportedLoad | None) -> float:
    """The load the policy balances by (the rule atop this file); `report` fresh or None."""
    if report is None:
        return float(inflight)
    queued = report.queued_prompt_tokens / QUEUED_TOKENS_PER_REQUEST
    return max(inflight, report.requests_in_flight) + queued
