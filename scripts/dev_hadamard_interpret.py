"""Runs the Hadamard + FP4 kernel's GPU test (tests/gpu/test_triton_hadamard.py) on the CPU
through Triton's interpreter, in float32 only (Triton 3.6's interpreter truncates fp32 -> bf16
casts, so the bf16 cases are for the GPU):

    TRITON_INTERPRET=1 .venv/bin/python scripts/dev_hadamard_interpret.py
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")
sys.path[:0] = ["tests", "tests/gpu"]

import test_triton_hadamard as t  # noqa: E402
import torch  # noqa: E402

for shape in ((1, 64, 128), (7, 128), (33, 4, 128), (5, 8, 64)):
    t.test_equals_the_eager_reference_bit_for_bit(shape, torch.float32)
    print(f"ok {shape}")
print("equal bit for bit")
