"""How many prefill tokens a step may carry while requests decode (`--max-decode-slowdown R`).

Every decoding request waits for the whole step, so a prefill chunk of thousands of tokens
turns one decode step into many (measured on the H200: dsv4-mini's batch-64 step 36 ms, TPOT at
concurrency 64 85 ms). With R > 0, a step with decoding requests takes at most as many prefill
tokens as keep its predicted time within R x that of the decode rows alone; prefills then take
more steps (TTFT grows) and decode keeps its pace. Both predictions come from the engine's own
recent steps: decode-only steps fit ms = a + b * rows (least squares over a window), and mixed
steps give the cost of a prefill token (a moving average of what the step took beyond its decode
rows' prediction, per prefill token). Until both are measured the cap is the step's whole budget
(what R = 0 always is). A step never takes fewer than `min_tokens` prefill tokens, so a prompt
always progresses.
"""

from __future__ import annotations

from collections import deque

WINDOW = 256  # recent decode-only steps in the fit
MIN_MEASURED_TOKENS = 32  # mixed steps with fewer prefill tokens say too little about their cost
EWMA = 0.2


class PrefillBudget:
    def __init__(self, max_slowdown: float, min_tokens: int, max_tokens: int) -> None:
        if max_slowdown and max_slowdown <= 1.0:
            raise ValueError("--max-decode-slowdown must be above 1 (or 0: off)")
        self.max_slowdown, self.min_tokens, self.max_tokens = max_slowdown, min_tokens, max_tokens
        self.decode_steps: deque[tuple[int, float]] = deque()  # (rows, ms), the last WINDOW
        self._sums = [0.0] * 5  # over them: rows, ms, rows², rows·ms, count (O(1) per step)
        self.ms_per_token: float | None = None
        self.last_cap = max_tokens

    def decode_ms(self, rows: int) -> float | None:
        """Predicted ms of a decode-only step of `rows` rows (None: not measured yet)."""
        sr, st, srr, srt, n = self._sums
        if not n:
            return None
        mx, my = sr / n, st / n
        var = srr - n * mx * mx
        b = (srt - n * mx * my) / var if var > 1e-9 else 0.0
        return max(my + max(b, 0.0) * (rows - mx), 1e-3)

    def _add_decode_step(self, rows: int, ms: float, sign: float = 1.0) -> None:
        for i, v in enumerate((rows, ms, rows * rows, rows * ms, 1)):
            self._sums[i] += sign * v

    def observe(self, decode_rows: int, prefill_tokens: int, ms: float) -> None:
        """A finished step: its decode rows (one token each), prefill tokens and wall time."""
        if not self.max_slowdown or decode_rows + prefill_tokens == 0:
            return
        if prefill_tokens == 0:
            self.decode_steps.append((decode_rows, ms))
            self._add_decode_step(decode_rows, ms)
            if len(self.decode_steps) > WINDOW:
                self._add_decode_step(*self.decode_steps.popleft(), sign=-1.0)
            return
        base = self.decode_ms(decode_rows) if decode_rows else 0.0
        if base is None or prefill_tokens < MIN_MEASURED_TOKENS:
            return
        per = max(ms - base, 0.0) / prefill_tokens
        m = self.ms_per_token
        self.ms_per_token = per if m is None else (1 - EWMA) * m + EWMA * per

    def cap(self, decode_rows: int) -> int:
        """Prefill tokens the next step may carry beside `decode_rows` decoding requests."""
        cap = self.max_tokens
        if self.max_slowdown and decode_rows:
            base = self.decode_ms(decode_rows)
            if base is not None and self.ms_per_token:
                room = (self.max_slowdown - 1.0) * base / self.ms_per_token
                cap = max(self.min_tokens, min(int(room), self.max_tokens))
        self.last_cap = cap
        return cap
