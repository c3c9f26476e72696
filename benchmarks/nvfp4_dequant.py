"""One routed expert of dsv4-mini/Flash dequantized from NVFP4 to bf16, as the MoE's reference
path does for every expert a token routes to: torch reference vs the Triton kernel.

Floor: bytes read (packed e2m1 + e4m3 scales) + bytes written (bf16) over the copy ceiling.
    python benchmarks/nvfp4_dequant.py --out bench-results/nvfp4_dequant.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from kvrelay.kernels.triton_nvfp4 import dequantize_nvfp4
from kvrelay.quant.nvfp4 import dequantize_nvfp4 as reference

COPY_CEILING = 4.24e12  # bytes/s, H200 device copy (shared/reference/gpu-machine.md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--sets", type=int, default=8, help="input sets rotated (beat the L2)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    h, i = a.hidden, a.intermediate
    shapes = {"gate_up": ((2, i, h), 2), "down": ((1, h, i), 1)}
    rows = []
    for name, ((m, n, k), matrices) in shapes.items():
        sets = [
            (
                torch.randint(0, 256, (m, n, k // 2), dtype=torch.uint8, device="cuda"),
                (torch.rand(m, n, k // 16, device="cuda") * 2 + 0.5).to(torch.float8_e4m3fn),
                torch.rand(matrices, device="cuda") * 1e-2,
            )
            for _ in range(a.sets)
        ]
        assert torch.equal(dequantize_nvfp4(*sets[0]), reference(*sets[0]))
        moved = m * n * (k // 2 + k // 16 + 2 * k)
        for impl, fn in (("torch", reference), ("triton", dequantize_nvfp4)):
            it = iter(range(10**9))
            ms = triton.testing.do_bench(
                lambda fn=fn, it=it, s=sets: fn(*s[next(it) % len(s)]), return_mode="median"
            )
            rows.append(
                {
                    "matrix": name,
                    "impl": impl,
                    "ms": ms,
                    "GB_s": moved / ms / 1e6,
                    "floor_ms": moved / COPY_CEILING * 1e3,
                }
            )
    print(f"{'matrix':<8} {'impl':<7} {'ms':>8} {'GB/s':>8} {'floor ms':>9}")
    for r in rows:
        print(
            f"{r['matrix']:<8} {r['impl']:<7} {r['ms']:>8.4f} {r['GB_s']:>8.0f} {r['floor_ms']:>9.4f}"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
