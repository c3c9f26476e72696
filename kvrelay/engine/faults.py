"""TEST ONLY: faults the engine loop can inject (config fault_* and test_step_delay_s, the CLI's
--fault-* / --test-* flags): a sticky CUDA error, a slow step, a sampled token swapped. The
engine holds one only when a flag is set (`engine_faults`); its loop calls it where the fault
happens, and nothing else of it runs otherwise."""

from __future__ import annotations

import random
import time

from kvrelay.config import EngineConfig


class EngineFaults:
    def __init__(self, cfg: EngineConfig, rng: random.Random, vocab_size: int) -> None:
        self.sticky_error_after = cfg.fault_sticky_error_after
        self.step_delay_s = cfg.test_step_delay_s
        self.swap_p = cfg.fault_swap_token_p
        self.swap_min_batch = cfg.fault_swap_token_min_batch
        self.vocab_size = vocab_size
        self.rng = rng  # the engine's own: a swap draws where it always drew

    def before_forward(self, batch_steps: int) -> None:
        """Before a batch step's forward: raise the sticky error, or stall the step."""
        if 0 < self.sticky_error_after <= batch_steps:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (test fault)")
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)

    def swaps(self, batch_size: int) -> bool:
        """Whether this step's sampled tokens may be swapped (only above a batch size)."""
        return self.swap_p > 0 and batch_size > self.swap_min_batch

    def swap(self, tok: int) -> int:
        """A sampled token, swapped for the next one with probability fault_swap_token_p."""
        return (tok + 1) % self.vocab_size if self.rng.random() < self.swap_p else tok


def engine_faults(cfg: EngineConfig, rng: random.Random, vocab_size: int) -> EngineFaults | None:
    """The faults the config asks for, or None (every fault flag off)."""
    on = cfg.fault_sticky_error_after > 0 or cfg.test_step_delay_s > 0 or cfg.fault_swap_token_p > 0
    return EngineFaults(cfg, rng, vocab_size) if on else None
