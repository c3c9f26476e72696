"""The mHC pre-side kernels alone (`kernels/triton_mhc.hc_pre`: stream mix partials, then gates +
Sinkhorn + collapse + RMSNorm) at DeepSeek-V4's shapes (4 streams, hidden 4096, bf16), timed
inside a CUDA graph of 40 calls (one decode step's sub-layers), for this tree's kernels and for
those of another commit (`--old`, default HEAD), and the two crossed (this tree's mix with the
old finish) so each kernel's change shows by itself.

    python benchmarks/hc_pre_kernels.py --tokens 1,8,64 --out bench-results/hc_pre.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import torch

from kvrelay.kernels import triton_mhc
from kvrelay.models.deepseek_v4.mhc import HyperConnection
from kvrelay.models.deepseek_v4.norms import RMSNorm

CALLS = 40  # sub-layers per dsv4-mini decode step


def _module_at(commit: str):
    """The kernels module at a commit, or from a file (`--old path/to/triton_mhc.py`)."""
    if os.path.isfile(commit):
        with open(commit) as f:
            src = f.read()
    else:
        src = subprocess.run(
            ["git", "show", f"{commit}:kvrelay/kernels/triton_mhc.py"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    f = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    f.write(src)
    f.close()
    spec = importlib.util.spec_from_file_location(f"triton_mhc_old_{abs(hash(commit))}", f.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # triton's jit reads the source through the module
    spec.loader.exec_module(mod)
    return mod


def _time_graph(fn, reps: int = 20) -> float:
    """us per call: the graph of CALLS calls replayed `reps` times."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()  # compile + warm
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * CALLS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--old", default="HEAD")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    d = args.hidden
    hc = HyperConnection(4, d, 20, 1e-6, 1e-6).cuda()
    norm = RMSNorm(d, 1e-6).cuda()
    with torch.no_grad():
        hc.fn.normal_(0, d**-0.5)
        hc.base.normal_()
    variants = {"new": triton_mhc.hc_pre}
    try:
        old, crossed = _module_at(args.old), _module_at(args.old)
        crossed._hc_mix_kernel = triton_mhc._hc_mix_kernel  # this tree's mix, the old finish
        variants = {"old": old.hc_pre, "new mix + old finish": crossed.hc_pre} | variants
    except subprocess.CalledProcessError as e:
        print(f"no kernels at {args.old}: {e.stderr.strip()}")
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        streams = torch.randn(t, 4, d, device="cuda").bfloat16()
        pending = (
            torch.randn(t, d, device="cuda").bfloat16(),
            torch.rand(t, 4, device="cuda") * 2,
            torch.rand(t, 4, 4, device="cuda") / 4,
        )
        row = {"tokens": t}
        for name, pre in variants.items():
            with torch.no_grad():
                call = functools.partial(hc.pre_fused, pre, streams, pending, norm)
                row[name] = round(_time_graph(call), 2)
        rows.append(row)
        print(f"T={t:4d}  " + "  ".join(f"{k}: {v} us" for k, v in row.items() if k != "tokens"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"hidden": d, "calls_per_graph": CALLS, "old": args.old, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
