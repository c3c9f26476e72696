"""Compile a Triton kernel for sm_90 without a GPU and count what it turned into: the TTGIR ops
that matter for a GEMM (async copies, shared-memory stores/loads, layout conversions, MMAs),
and the SASS instructions (shared-memory, global, MMA, integer/float ALU), the registers and
shared memory per program. For design work on kernels before spending GPU time.

    python scripts/triton_sass.py  # the MoE gate-up kernel at the default decode configs
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
NVDISASM, CUOBJDUMP = os.path.join(_BIN, "nvdisasm"), os.path.join(_BIN, "cuobjdump")


def compile_kernel(
    fn,
    signature: dict,
    constexprs: dict,
    num_warps: int = 4,
    num_stages: int = 3,
    aligned=("K", "N_INTER"),
):
    sig = dict(signature) | {k: "constexpr" for k in constexprs}
    # what the launcher specializes on for real tensors: pointers and strides divisible by 16
    div16 = [
        n
        for n, t in signature.items()
        if t.startswith("*") or n.startswith("stride") or n in aligned
    ]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages}
    )


def sass(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True).stdout


SASS_GROUPS = {
    "LDS": r"\bLDS|LDSM",
    "STS": r"\bSTS",
    "LDG": r"\bLDG",
    "LDGSTS": r"LDGSTS",
    "MMA": r"HMMA|HGMMA",
    "F2F/I2F": r"\bF2F|\bI2F|F2FP",
    "IMAD/LOP": r"\bIMAD|\bLOP3|\bSHF|\bPRMT",
    "FMUL/FFMA": r"\bFMUL|\bFFMA|\bHMUL2|\bHFMA2",
    "BAR": r"\bBAR|\bDEPBAR|SYNCS",
    "total": r"^\s+/\*[0-9a-f]+\*/",
}


def registers(kernel) -> int:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True
        ).stdout
    m = re.search(r"REG:(\d+)", out)
    return int(m.group(1)) if m else -1


def main_loop(code: str) -> list[str]:
    """The instructions of the longest loop (a backward branch to a label) in the SASS."""
    lines = code.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"\.L_x_(\d+):", ln))}
    best: list[str] = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.L_x_(\d+)", ln)
        if m and labels.get(m.group(1), i) < i:
            body = [
                x for x in lines[labels[m.group(1)] : i + 1] if re.match(r"\s+/\*[0-9a-f]{4}\*/", x)
            ]
            best = max(best, body, key=len)
    return best


def opcode(line: str) -> str:
    return re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", line).split()[0].split(".")[0]


def report(name: str, kernel, weights_per_iter: float | None = None) -> None:
    ttgir = kernel.asm["ttgir"]
    ir = {
        k: len(re.findall(p, ttgir))
        for k, p in {
            "async_copy": r"async_copy_global_to_local",
            "local_store": r"ttg\.local_store|ttg\.local_alloc %",
            "local_load": r"ttg\.local_load",
            "convert_layout": r"ttg\.convert_layout",
            "dot": r"tt\.dot |warp_group_dot",
        }.items()
    }
    code = sass(kernel)
    counts = {k: len(re.findall(p, code, re.M)) for k, p in SASS_GROUPS.items()}
    print(f"{name}: regs={registers(kernel)} smem={kernel.metadata.shared} ttgir={ir}")
    print("   sass:", counts)
    loop = main_loop(code)
    ops = collections.Counter(opcode(x) for x in loop)
    per = f", {len(loop) / weights_per_iter:.2f} per weight" if weights_per_iter else ""
    print(f"   main loop: {len(loop)} instructions per thread{per}: {dict(ops.most_common(10))}")


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    from kvrelay.kernels import triton_moe as tm

    base = {
        "x_ptr": "*bf16",
        "w_ptr": "*u8",
        "s_ptr": "*u8",
        "gs_ptr": "*fp32",
        "rw_ptr": "*fp32",
        "tok_ptr": "*i32",
        "blk_e_ptr": "*i32",
        "blk_rows_ptr": "*i32",
        "act_ptr": "*bf16",
        "K": "i32",
        "N_INTER": "i32",
        "top_k": "i32",
        "limit": "fp32",
        "stride_x": "i32",
        "stride_we": "i64",
        "stride_wn": "i32",
        "stride_se": "i64",
        "stride_sn": "i32",
    }
    for cfg in (tm.MoeConfig(16, 64, 128, 4, 3), tm.MoeConfig(16, 64, 128, 4, 3, swap_ab=True)):
        ce = {
            "FP4": True,
            "HAS_LIMIT": True,
            "SWAP": cfg.swap_ab,
            "PREC": "tf32",
            "MX": False,
            "GROUP": 16,
            "BM": cfg.block_m,
            "BN": cfg.block_n,
            "BK": cfg.block_k,
            "EVEN_K": True,
            "ODT": triton.language.bfloat16,
        }
        k = compile_kernel(tm._gate_up_kernel, base, ce, cfg.num_warps, cfg.num_stages)
        report(f"gate_up nvfp4 {cfg}", k, 2 * cfg.block_n * cfg.block_k / (32 * cfg.num_warps))
