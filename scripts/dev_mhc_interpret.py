"""Runs the fused mHC kernels' GPU tests (tests/gpu/test_triton_mhc.py) on the CPU through
Triton's interpreter, at small token counts (the interpreter is slow), in float32 only: Triton
3.6's interpreter truncates fp32 -> bf16 casts (half of all values land one ulp below torch's
round-to-nearest), so the bf16 cases, and the batch-invariance test, are for the GPU.

    TRITON_INTERPRET=1 .venv/bin/python scripts/dev_mhc_interpret.py
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")
sys.path[:0] = ["tests", "tests/gpu"]

import test_triton_mhc as t  # noqa: E402
import torch  # noqa: E402

for d in (64, 256):
    for dtype in (torch.float32,):
        for merge in (False, True):
            for tokens in (1, 7, 33):
                t0 = time.perf_counter()
                t.test_pre_equals_the_torch_path(tokens, d, dtype, merge)
                print(
                    f"ok d={d} {dtype} merge={merge} T={tokens} ({time.perf_counter() - t0:.1f} s)"
                )
print("all equal the torch path")
# Not here: test_a_row_alone_equals_the_row_in_a_batch. The interpreter's tl.dot is numpy's
# matmul, whose BLAS kernel rounds a row differently at another position in the block.
