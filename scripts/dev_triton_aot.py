"""Compile a Triton kernel for the H100/H200 (sm_90) on a machine without a GPU: the frontend,
the layout passes, LLVM and ptxas all run on the CPU, so a type error, a bad loop-carried
variable or a shared-memory overflow shows here before any device time is spent. (The Triton
interpreter runs the kernel's values but checks none of this.)

Arguments whose name ends in `_ptr` are pointers to --dtype unless named in --arg; the others are
i32 unless named in --arg; constexprs are given as NAME=VALUE (ints, floats, True/False).

    pip download --no-deps triton==3.6.0 (then unzip it to DIR and chmod +x its nvidia/bin/*)
    PYTHONPATH=DIR python scripts/dev_triton_aot.py \\
        kvrelay.kernels.triton_invariant_attention:_invariant_attention_kernel --dtype bf16 \\
        --arg pt_ptr=*i32 --arg seq_lens_ptr=*i32 --arg cu_ptr=*i32 --arg scale=fp32 \\
        G=3 BLOCK_G=16 HEAD_DIM=64 PAGE_SIZE=16 BLOCK_N=64 IEEE=False
"""

from __future__ import annotations

import argparse
import ast
import importlib

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", help="module:attribute of a @triton.jit function")
    ap.add_argument("constexprs", nargs="*", help="NAME=VALUE")
    ap.add_argument("--dtype", default="bf16", help="what pointer arguments point to")
    ap.add_argument("--arg", action="append", default=[], help="NAME=TYPE (e.g. scale=fp32)")
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_intermixed_args()
    module, _, name = a.kernel.partition(":")
    fn = getattr(importlib.import_module(module), name)
    consts = {k: ast.literal_eval(v) for k, v in (c.split("=", 1) for c in a.constexprs)}
    types = dict(t.split("=", 1) for t in a.arg)
    sig = {}
    for arg in fn.arg_names:
        if arg in consts:
            sig[arg] = "constexpr"
        else:
            sig[arg] = types.get(arg, f"*{a.dtype}" if arg.endswith("_ptr") else "i32")
    src = ASTSource(
        fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}
    )
    k = triton.compile(src, target=GPUTarget("cuda", a.arch, 32))
    print(f"{name} sm_{a.arch}: compiled; shared memory {k.metadata.shared} B, "
          f"{k.metadata.num_warps} warps, ptx {len(k.asm['ptx'])} chars")  # fmt: skip


if __name__ == "__main__":
    main()
