"""Attention and cache kernels: torch references (oracles, CPU path) beside their Triton versions."""
