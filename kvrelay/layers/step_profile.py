"""Where one engine step's time goes: attention / MLP or MoE / communication / other.

A region is timed by a pair of CUDA events on the current stream (read once the step is over: no
sync inside the forward) or, on CPU, by the wall clock. `other` is the step's wall time minus the
regions: embeddings, norms, logits, sampling, scheduling and the host time between kernels.
A decode step that replays a CUDA graph is timed inside the graph: the runner keeps a second
variant of each graph whose regions were captured as event-record nodes (`in_graph`), so the
profiled step runs the same kernels as any other.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

ATTENTION, MLP, MOE, COMMUNICATION, OTHER = "attention", "mlp", "moe", "communication", "other"


class StepProfiler:
    """Times named regions of one step; regions must not nest (an inner one is not timed)."""

    def __init__(self, device: torch.device, in_graph: bool = False) -> None:
        self.cuda = device.type == "cuda"
        # in_graph: the regions are recorded while a CUDA graph is captured; each replay
        # re-records their events, and totals() reads the latest replay.
        self.in_graph = in_graph
        self._events: list[torch.cuda.Event] = []  # reused from step to step
        self._spans: list[tuple[str, object, object]] = []  # (component, start, end)
        self._replayed: list[StepProfiler] = []  # graphs replayed this step, timed inside
        self._depth = 0
        self.skipped = False  # this step cannot be split (a graph variant was being captured)

    def _mark(self, i: int):
        if not self.cuda:
            return time.perf_counter()
        while len(self._events) <= i:
            self._events.append(torch.cuda.Event(enable_timing=True, external=self.in_graph))
        ev = self._events[i]
        ev.record()
        return ev

    @contextmanager
    def region(self, component: str):
        if self._depth:
            yield
            return
        self._depth += 1
        start = self._mark(2 * len(self._spans))
        try:
            yield
        finally:
            self._depth -= 1
            self._spans.append((component, start, self._mark(2 * len(self._spans) + 1)))

    def totals(self) -> dict[str, float]:
        """Milliseconds per component of the regions recorded (waits for the last one)."""
        if self.cuda and self._spans:
            self._spans[-1][2].synchronize()
        out: dict[str, float] = {}
        for name, start, end in self._spans:
            ms = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
            out[name] = out.get(name, 0.0) + ms
        return out

    def replayed(self, graph_regions: StepProfiler) -> None:
        """This step replayed a graph captured with `graph_regions`: count its regions too."""
        self._replayed.append(graph_regions)

    def finish(self, step_ms: float) -> dict[str, float] | None:
        """Milliseconds per component for the step that took `step_ms` of wall time (the
        GPU work is complete by then: sampling read the tokens back), None if the step was
        skipped. Resets for the next step."""
        out: dict[str, float] = {COMMUNICATION: 0.0}
        for part in (self, *self._replayed):
            for name, ms in part.totals().items():
                out[name] = out.get(name, 0.0) + ms
        skipped, self.skipped = self.skipped, False
        self._spans.clear()
        self._replayed.clear()
        if skipped:
            return None
        out[OTHER] = max(step_ms - sum(out.values()), 0.0)
        return out


def timed(profile: StepProfiler | None, component: str) -> AbstractContextManager:
    """`with timed(ctx.profile, ATTENTION): ...` — free when the step is not profiled."""
    return nullcontext() if profile is None else profile.region(component)
