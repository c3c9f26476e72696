"""The Triton attention kernels under TRITON_INTERPRET=1 (CPU) against the torch reference.

TRITON_INTERPRET must be set before the kernels are defined, so the kernels run in a child
process (this file run as a script); the env var never reaches other tests.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

# name -> (kind, dtype, seq_lens, q_lens or None for decode, Hq, Hkv, D, page_size, num_splits)
CASES = {
    "prefill_fp32": ("prefill", "float32", [1, 15, 16, 50], [1, 15, 16, 50], 4, 2, 32, 16, None),
    "chunked_gqa3_multi_page_tile": (
        "prefill", "float32", [1, 40, 70, 33], [1, 7, 1, 33], 6, 2, 32, 8, None
    ),
    "chunked_page_bigger_than_tile": (
        "prefill", "float32", [100, 130], [100, 30], 2, 1, 64, 128, None
    ),
    "prefill_gqa8_d128_page256": (
        "prefill", "float32", [300, 17], [300, 17], 8, 1, 128, 256, None
    ),
    "chunked_gqa3_ragged_q_blocks": ("prefill", "float32", [150, 9], [100, 2], 3, 1, 32, 16, None),
    "mixed_fp16": ("prefill", "float16", [20, 64, 5], [1, 17, 5], 8, 2, 64, 16, None),
    "decode_fp32_split1": ("decode", "float32", [1, 15, 16, 200], None, 4, 4, 32, 16, 1),
    "decode_fp32_gqa3_split3": ("decode", "float32", [1, 15, 16, 200], None, 6, 2, 32, 16, 3),
    "decode_gqa4_split7_empty": ("decode", "float32", [0, 1, 63, 300], None, 8, 2, 32, 32, 7),
    "decode_gqa8_d128_page256": ("decode", "float32", [1, 700], None, 16, 2, 128, 256, 4),
    "decode_fp16_default_splits": ("decode", "float16", [3, 129], None, 4, 1, 64, 16, None),
}  # fmt: skip

# The interpreter runs bf16 dots on the raw uint16 bits (Triton 3.6), so the low-precision
# path is checked here in fp16; bf16 is covered by tests/gpu/test_triton_attention.py.
TOL = {"float32": 1e-5, "float16": 2e-3}


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, float]]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed, so the kernels cannot run in its interpreter")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(results, name):
    r = results[name]
    assert r["unwritten"] == 0, "some output elements were not written (NaN poison left)"
    assert r["rel_err"] <= TOL[CASES[name][1]], r


def _inputs(torch, seq_lens, q_lens, hq, hkv, d, page_size, dtype, gen):
    """Random cache behind a shuffled page table; unused slots and spare pages are NaN."""
    b = len(seq_lens)
    max_pages = max(math.ceil(max(s, 1) / page_size) for s in seq_lens) + 1
    num_pages = b * max_pages + 3
    page_table = torch.randperm(num_pages, generator=gen)[: b * max_pages].view(b, max_pages)
    k_cache = torch.full((num_pages, page_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    for i, s in enumerate(seq_lens):
        slots = torch.arange(s)
        pages = page_table[i, slots // page_size]
        k_cache[pages, slots % page_size] = torch.randn(s, hkv, d, generator=gen).to(dtype)
        v_cache[pages, slots % page_size] = torch.randn(s, hkv, d, generator=gen).to(dtype)
    t = sum(q_lens) if q_lens else b
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return q, k_cache, v_cache, page_table.to(torch.int32), seq


def _run_case(torch, ref, tri, case, seed):
    kind, dtype_name, seq_lens, q_lens, hq, hkv, d, page_size, num_splits = case
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    q, kc, vc, pt, seq = _inputs(torch, seq_lens, q_lens, hq, hkv, d, page_size, dtype, gen)
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    if kind == "prefill":
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        tri.paged_attention(q, kc, vc, pt, seq, cu, scale, max(q_lens), out=out)
    else:
        cu = torch.tensor([0, *(seq > 0).to(torch.int32).cumsum(0).tolist()], dtype=torch.int32)
        tri.paged_decode_attention(q, kc, vc, pt, seq, scale, num_splits=num_splits, out=out)
    # The reference has no token for an empty sequence; the kernel must give it zeros.
    live = seq > 0 if kind == "decode" else torch.ones(q.shape[0], dtype=torch.bool)
    expect = torch.zeros_like(q, dtype=torch.float64)
    expect[live] = ref.paged_attention(q[live], kc, vc, pt, seq, cu, scale).double()
    unwritten = int(out.isnan().sum())
    got = out.double().nan_to_num(0.0)
    rel = float((got - expect).norm() / expect.norm())
    return {"rel_err": rel, "max_abs": float((got - expect).abs().max()), "unwritten": unwritten}


def _patch_interpreter_for_numpy_2_4() -> None:
    # Triton 3.6's interpreter calls int() on 1-element arrays, which numpy >= 2.4 refuses
    # (triton-lang/triton#9171): runtime loop bounds such as range(start, end) then fail.
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def _main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _patch_interpreter_for_numpy_2_4()
    import torch

    from kvrelay.kernels import reference as ref
    from kvrelay.kernels import triton_attention as tri

    results = {
        name: _run_case(torch, ref, tri, CASES[name], seed)
        for seed, name in enumerate(sorted(CASES))
    }
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
