"""Per-step engine telemetry kept in the API process: a bounded ring that `kvrelay bench` reads over
HTTP (GET /telemetry/steps?since=N) to fit the step-time model. Profiled steps also carry their
split into components (ms of attention, mlp or moe, communication, other)."""

from __future__ import annotations

import time
from collections import deque

from kvrelay.engine.messages import StepOutputs

DEFAULT_CAPACITY = 32768  # steps; at 20 ms a step, about 11 minutes of history


class StepTelemetry:
    """Every engine step that ran a batch, numbered from 0; the oldest fall off past `capacity`."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.steps: deque[tuple] = deque(maxlen=capacity)
        self.next_seq = 0
        self.profile_every = 0  # what the engine was last told (POST /telemetry/profile)

    def on_step(self, msg: StepOutputs) -> None:
        s = msg.stats
        if s is None or not s.batch_size:  # an idle step carries a stale step_ms
            return
        row = (
            self.next_seq,
            time.time(),
            s.batch_size,
            s.num_tokens,
            s.step_ms,
            s.num_prefill,
            s.components,
            s.prefill_cap,
        )
        self.steps.append(row)
        self.next_seq += 1

    def since(self, seq: int, limit: int | None = None) -> dict:
        """Steps numbered `seq` and later (at most `limit`), the number to ask for next time, and
        `head`, the number the next step will get. `dropped` counts requested steps that already
        fell off the ring."""
        oldest = self.steps[0][0] if self.steps else self.next_seq
        start = max(seq, oldest)
        rows = [r for r in self.steps if r[0] >= start] if start < self.next_seq else []
        if limit is not None:
            rows = rows[:limit]
        return {
            "next": rows[-1][0] + 1 if rows else start,
            "head": self.next_seq,
            "dropped": max(oldest - seq, 0),
            "steps": [_step_dict(*r) for r in rows],
        }


def _step_dict(seq, t, batch, tokens, ms, prefill, components, prefill_cap) -> dict:
    d = {
        "seq": seq,
        "time": t,
        "batch_size": batch,
        "num_tokens": tokens,
        "step_ms": ms,
        "num_prefill": prefill,
    }
    if components is not None:
        d["components"] = components
    if prefill_cap:
        d["prefill_cap"] = prefill_cap
    return d
