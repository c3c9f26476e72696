"""TEST ONLY: faults a prefill sender can inject (config test_corrupt_p and
test_delay_transfer_s, the CLI's --test-corrupt-transfer and --test-delay-transfer; the fault
campaign and tests/disagg use them): a piece damaged after its checksum was taken, a stalled
link. A sender holds a `SendFaults` only when a flag is set (`send_faults`, or a test installs
one); its hot path calls the hook where the fault happens and nothing else of it otherwise."""

from __future__ import annotations

import queue
import random
import threading
import time

import torch

from kvrelay.config import EngineConfig
from kvrelay.disagg import protocol as P
from kvrelay.disagg.transport.base import Connection

CORRUPT_BYTES = 16  # whole bytes: exponents too, never a benign change


class DelayedSends:
    """Frames sent `delay_s` late, in order, from a thread of their own (a stalled link)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.q: queue.Queue[tuple[float, Connection, bytes, list]] = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="kvrelay-test-delay").start()

    def put(self, conn: Connection, header: bytes, buffers) -> None:
        self.q.put((time.monotonic() + self.delay_s, conn, header, list(buffers)))

    def _run(self) -> None:
        while True:
            due, conn, header, buffers = self.q.get()
            time.sleep(max(due - time.monotonic(), 0.0))
            try:
                conn.send(header, buffers)
            except ConnectionError:
                pass  # the connection's reader thread reports the loss


class CorruptPiece:
    """Damages the first piece of a transfer that has CORRUPT_BYTES bytes (a PieceFault)."""

    def __init__(self) -> None:
        self.armed = True

    def fires(self, nbytes: int) -> bool:
        if not self.armed or nbytes < CORRUPT_BYTES:
            return False
        self.armed = False  # the first non-empty piece only
        return True

    def damaged(self, buf: memoryview) -> memoryview:
        corrupted = bytearray(buf)
        mid = len(corrupted) // 2
        end = mid + CORRUPT_BYTES
        corrupted[mid:end] = bytes(b ^ 0xFF for b in corrupted[mid:end])
        return memoryview(corrupted)

    def damage(self, row: torch.Tensor) -> None:
        row[:CORRUPT_BYTES] ^= 0xFF


class SendFaults:
    """A sender's faults: which transfers get a damaged piece, which frames go late."""

    def __init__(self, corrupt_p: float, delay_s: float, seed: int) -> None:
        self.corrupt_p = corrupt_p
        self.rng = random.Random(seed)
        self.delayed = DelayedSends(delay_s) if delay_s > 0 else None

    def piece_fault(self) -> CorruptPiece | None:
        """A new transfer's fault: damage to its first non-empty piece, with p = corrupt_p."""
        return CorruptPiece() if self.rng.random() < self.corrupt_p else None

    def delays(self, msg: P.Message) -> bool:
        # Released goes the same way: it must not overtake the pieces it says are the last.
        return self.delayed is not None and isinstance(
            msg, P.ChunkHeader | P.FirstToken | P.Released
        )

    def send_late(self, conn: Connection | None, msg: P.Message, buffers=()) -> bool:
        """Send a frame `delays` picked, late; False when the connection is gone already."""
        if conn is None or conn.closed:
            return False
        self.delayed.put(conn, P.encode(msg), buffers)
        return True


def send_faults(cfg: EngineConfig) -> SendFaults | None:
    """The faults the config asks for, or None (no fault flag set)."""
    d = cfg.disagg
    if d.test_corrupt_p <= 0 and d.test_delay_transfer_s <= 0:
        return None
    return SendFaults(d.test_corrupt_p, d.test_delay_transfer_s, cfg.seed)
