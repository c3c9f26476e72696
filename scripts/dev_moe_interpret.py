"""Checks the Triton fused MoE (kvrelay/kernels/triton_moe.py) on the CPU through Triton's
interpreter, against the torch reference `Experts.forward`: the grouping kernel against the
torch grouping, the e2m1 decode over every byte, dense fp32/bf16 and NVFP4 experts on small
shapes, masked and unmasked K, both operand orders, both NVFP4 routes, and the NVFP4 routes
against an fp64 oracle. Slow (the interpreter), so shapes stay small.

    TRITON_INTERPRET=1 .venv/bin/python scripts/dev_moe_interpret.py

With --compile (TRITON_INTERPRET unset) it compiles the NVFP4 GEMM variants that the defaults,
the GPU tests and the benchmark sweep use for sm_90 instead (Triton's bundled ptxas, no GPU
needed), with DeepSeek-V4-mini's stride alignment, and prints registers, spills (stack),
shared memory, MMA instructions and the main loop's instruction count per variant.
"""

from __future__ import annotations

import os
import sys
import time

COMPILE = "--compile" in sys.argv
if COMPILE == (os.environ.get("TRITON_INTERPRET") == "1"):
    sys.exit("checks: run with TRITON_INTERPRET=1; --compile: run without it")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvrelay.kernels import triton_moe  # noqa: E402
from kvrelay.kernels.moe_grouping import group_by_expert  # noqa: E402
from kvrelay.kernels.triton_moe import MoeConfig, fused_experts, group_assignments  # noqa: E402
from kvrelay.models.deepseek_v4 import preset  # noqa: E402
from kvrelay.models.deepseek_v4.experts import Experts, Fp4Experts  # noqa: E402
from kvrelay.quant.fp4 import decode_e2m1  # noqa: E402


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into an int with int(array of shape [1]), which
    numpy >= 2.4 refuses; a loop bound such as `range(0, n, CH)` with a runtime n then fails.
    Take the single element instead (interpreter only; compiled kernels are unaffected)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _patch_interpreter_bf16_dot() -> None:
    """Triton 3.6's interpreter keeps bf16 as raw uint16 and its tl.dot multiplies those
    integers; widen bf16 operands to fp32 first (exact), as the tensor cores do."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            f = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None)
            return interpreter.TensorHandle(f.view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot

    # Its fp32 -> bf16 cast truncates; the GPU rounds to nearest even (as torch does).
    original_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = f.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits.copy(), tl.bfloat16)
        return original_cast(self, src, dst_type)

    builder.cast_impl = cast_impl


if not COMPILE:
    _patch_interpreter_index()
    _patch_interpreter_bf16_dot()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def make_experts(e: int, h: int, i: int, fp4: bool, dtype: torch.dtype, gen: torch.Generator):
    cfg = preset("dsv4-tiny").with_(
        n_routed_experts=e, hidden_size=h, moe_intermediate_size=i,
        expert_format="nvfp4" if fp4 else "dense",
    )  # fmt: skip
    if not fp4:
        ex = Experts(cfg, dtype)
        with torch.no_grad():
            ex.gate_up_proj.copy_(torch.randn(e, 2 * i, h, generator=gen) / h**0.5)
            ex.down_proj.copy_(torch.randn(e, h, i, generator=gen) / i**0.5)
        return ex
    ex = Fp4Experts(cfg, dtype)
    with torch.no_grad():
        for p, s in ((ex.gate_up_packed, ex.gate_up_scale), (ex.down_packed, ex.down_scale)):
            p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, generator=gen))
            s.copy_((torch.rand(s.shape, generator=gen) * 3 + 0.05).to(torch.float8_e4m3fn))
        ex.gate_up_scale_2.copy_(torch.rand(e, 2, generator=gen) * 0.1 / h**0.5 + 0.01 / h**0.5)
        ex.down_scale_2.copy_(torch.rand(e, generator=gen) * 0.1 / i**0.5 + 0.01 / i**0.5)
    return ex


def routing(t: int, e: int, k: int, mode: str, gen: torch.Generator):
    if mode == "topk":
        idx = torch.rand(t, e, generator=gen).topk(k, dim=-1).indices
    elif mode == "one":  # every token to the same experts
        idx = torch.randperm(e, generator=gen)[:k].expand(t, k).clone()
    else:  # hash-like: random, repeats across tokens
        idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen) + 0.1
    return w, idx


@triton.jit
def _decode_probe(b_ptr, lo_ptr, hi_ptr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    lo, hi = triton_moe._e2m1_pair(tl.load(b_ptr + r).to(tl.int32))
    tl.store(lo_ptr + r, lo * 16384.0)
    tl.store(hi_ptr + r, hi * 16384.0)


def check_e2m1() -> None:
    bytes_ = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    lo, hi = torch.empty(256), torch.empty(256)
    _decode_probe[(1,)](bytes_, lo, hi, BLOCK=256)
    assert torch.equal(lo, decode_e2m1(bytes_ & 15).float()), lo
    assert torch.equal(hi, decode_e2m1(bytes_ >> 4).float()), hi
    assert torch.equal(lo.signbit(), (bytes_ & 8).bool())  # -0 for code 8, like the LUT's sign
    print("e2m1 decode: both nibbles of all 256 bytes exact")


def check_grouping(gen: torch.Generator) -> None:
    for t, e, k, bm, mode in [
        (1, 8, 2, 16, "topk"), (7, 8, 2, 16, "hash"), (64, 8, 2, 16, "one"),
        (300, 8, 2, 32, "topk"), (5, 256, 6, 16, "topk"), (300, 256, 6, 16, "hash"),
        (40, 5, 3, 16, "topk"),
    ]:  # fmt: skip
        _, idx = routing(t, e, k, mode, gen)
        want = group_by_expert(idx, e, bm)
        got = group_assignments(idx, e, bm)
        assert torch.equal(got.block_expert, want.block_expert), (t, e, k)
        assert torch.equal(got.block_rows, want.block_rows), (t, e, k)
        rows = torch.arange(bm)[None, :] < want.block_rows[:, None]
        used = rows.reshape(-1)
        assert torch.equal(got.token_ids[used], want.token_ids[used]), (t, e, k)
        # the layout itself: every assignment once, in its expert's blocks
        flat = idx.reshape(-1)
        ids = want.token_ids[used].long()
        assert torch.equal(ids.sort().values, torch.arange(t * k))
        blk = want.block_expert.repeat_interleave(bm)[used].long()
        assert torch.equal(flat[ids], blk)
    print("grouping: triton kernel == torch reference, layout valid")


def check_moe(gen: torch.Generator) -> None:
    cases = [
        # E, H, I, k, T, fp4, dtype, routing, config
        (8, 64, 32, 2, 1, False, torch.float32, "topk", None),
        (8, 64, 32, 2, 7, False, torch.float32, "hash", MoeConfig(16, 32, 32, 4, 2, False)),
        (8, 160, 192, 2, 64, False, torch.float32, "one", None),
        (8, 160, 192, 2, 300, False, torch.float32, "topk", None),
        (8, 64, 32, 2, 7, False, torch.bfloat16, "topk", None),
        (8, 160, 192, 2, 64, False, torch.bfloat16, "hash", MoeConfig(16, 64, 64, 4, 2, False)),
        (8, 64, 32, 2, 1, True, torch.bfloat16, "topk", None),
        (8, 160, 192, 2, 7, True, torch.bfloat16, "hash", None),
        (8, 160, 192, 2, 64, True, torch.bfloat16, "one", MoeConfig(16, 32, 64, 4, 2, False)),
        (8, 160, 192, 2, 300, True, torch.bfloat16, "topk", None),
        (8, 160, 192, 2, 300, True, torch.float32, "topk", MoeConfig(32, 64, 32, 4, 2, True)),
        (8, 64, 32, 2, 64, True, torch.float32, "hash", None),
        (8, 64, 32, 2, 1100, True, torch.bfloat16, "topk", None),  # > GROUP_MAX_ASSIGN: torch
        # K a multiple of BLOCK_K (the unmasked EVEN_K path), both operand orders
        (8, 256, 128, 2, 7, True, torch.bfloat16, "topk", MoeConfig(16, 32, 128, 4, 3, False)),
        (8, 256, 128, 2, 64, True, torch.float32, "hash", MoeConfig(16, 64, 128, 4, 3, True)),
        (8, 256, 128, 2, 300, True, torch.bfloat16, "topk", MoeConfig(64, 64, 64, 4, 3, False)),
        (8, 256, 128, 2, 64, False, torch.bfloat16, "one", MoeConfig(16, 32, 128, 4, 3, False)),
        (8, 256, 128, 2, 64, False, torch.float32, "topk", MoeConfig(32, 32, 64, 4, 3, True)),
        # the fp16-MMA route (NVFP4, bf16 x), masked and unmasked K, both operand orders
        (8, 160, 192, 2, 7, True, torch.bfloat16, "hash", MoeConfig(16, 32, 64, 4, 2, False, True)),
        (
            8,
            256,
            128,
            2,
            64,
            True,
            torch.bfloat16,
            "one",
            MoeConfig(16, 32, 128, 4, 3, False, True),
        ),
        (
            8,
            256,
            128,
            2,
            300,
            True,
            torch.bfloat16,
            "topk",
            MoeConfig(64, 64, 64, 4, 3, True, True),
        ),
    ]
    for e, h, i, k, t, fp4, dtype, mode, cfg in cases:
        t0 = time.time()
        ex = make_experts(e, h, i, fp4, dtype, gen)
        for limit in (ex.limit, 0.0):
            ex.limit = limit
            x = (torch.randn(t, h, generator=gen) * 2).to(dtype)
            w, idx = routing(t, e, k, mode, gen)
            want = ex.forward(x, w, idx)
            got = fused_experts(x, w, idx, ex, cfg)
            err = rel_err(got, want)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert got.dtype == torch.float32 and got.shape == (t, h)
            assert torch.isfinite(got).all() and err < tol, (e, h, i, t, fp4, dtype, err)
            clamped = "clamp" if limit > 0 else "no clamp"
            print(
                f"E={e} H={h} I={i} k={k} T={t:<4} {'nvfp4' if fp4 else 'dense'} "
                f"{str(dtype)[6:]:<8} {mode:<4} {clamped:<8} {cfg or 'default'}: "
                f"rel err {err:.2e} ({time.time() - t0:.1f}s)"
            )


def exact_oracle(ex, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The MoE in float64 on exactly dequantized NVFP4 weights, no intermediate rounding."""
    from kvrelay.quant.nvfp4 import dequantize_nvfp4

    e, two_i, _ = ex.gate_up_packed.shape
    halves = (2, two_i // 2, -1)
    gu = torch.stack([
        dequantize_nvfp4(
            ex.gate_up_packed[j].view(halves), ex.gate_up_scale[j].view(halves),
            ex.gate_up_scale_2[j], torch.float64,
        ).flatten(0, 1)
        for j in range(e)
    ])  # fmt: skip
    dn = torch.stack([
        dequantize_nvfp4(ex.down_packed[j], ex.down_scale[j], ex.down_scale_2[j], torch.float64)
        for j in range(e)
    ])  # fmt: skip
    cfg = preset("dsv4-tiny").with_(
        n_routed_experts=e, hidden_size=x.shape[1], moe_intermediate_size=two_i // 2
    )
    ref = Experts(cfg, torch.float64)
    ref.limit = ex.limit
    with torch.no_grad():
        ref.gate_up_proj.copy_(gu)
        ref.down_proj.copy_(dn)
    return ref.forward(x.double(), w.double(), idx)


def check_accuracy_against_fp64(gen: torch.Generator) -> None:
    """Both NVFP4 routes against an fp64 oracle: the default route as far from it as the
    reference (it rounds the same weights), the fp16 route closer (its weights are exact)."""
    for h, i, t in ((256, 128, 7), (512, 256, 40)):
        ex = make_experts(8, h, i, True, torch.bfloat16, gen)
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        w, idx = routing(t, 8, 2, "topk", gen)
        exact = exact_oracle(ex, x, w, idx)
        ref = rel_err(ex.forward(x, w, idx), exact)
        errs = {}
        for f16 in (False, True):
            got = fused_experts(x, w, idx, ex, MoeConfig(16, 32, 128, 4, 3, False, f16))
            errs[f16] = rel_err(got, exact)
        assert errs[False] < 1.1 * ref and errs[True] < ref, (ref, errs)
        print(
            f"vs fp64 oracle H={h} I={i} T={t}: reference {ref:.2e}, default route "
            f"{errs[False]:.2e}, fp16 route {errs[True]:.2e}"
        )


def _sm90(fn, sig: dict[str, str], const: dict, opts: dict) -> str:
    """Compile fn for sm_90; registers, stack, shared memory, MMA count, main-loop length."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for c in const:
        sig[c] = "constexpr"
    aligned = [i for i, a in enumerate(sig) if a.endswith("_ptr") or a.startswith("stride")]
    aligned += [list(sig).index(a) for a in ("K", "N", "N_INTER") if a in sig]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    k = triton.compile(ASTSource(fn, sig, const, attrs), GPUTarget("cuda", 90, 32), opts)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    addr = {int(a, 16): i for i, (a, _) in enumerate(ins)}
    loop = 0
    for i, (a, text) in enumerate(ins):  # the longest backward branch: the K loop
        j = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if j and int(j.group(1), 16) < int(a, 16) and int(j.group(1), 16) in addr:
            loop = max(loop, i - addr[int(j.group(1), 16)])
    mma = sass.count("HGMMA") + sass.count("HMMA")
    regs, stack = m.groups() if m else ("?", "?")
    return f"regs={regs} stack={stack} shared={k.metadata.shared} mma={mma} loop={loop}"


def compile_report() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import moe_kernel

    cfgs = [triton_moe.default_config(n, 256) for n in (6, 6000, 12000, 24576)]
    cfgs += moe_kernel.SWEEP_SMALL + moe_kernel.SWEEP_LARGE
    for cfg in dict.fromkeys(cfgs):
        f16 = cfg.fp16_mma
        mdt, odt = ("fp16", tl.bfloat16) if f16 else ("bf16", tl.bfloat16)
        blocks = {"BM": cfg.block_m, "BN": cfg.block_n, "BK": cfg.block_k, "EVEN_K": True}
        common = {"FP4": True, "SWAP": cfg.swap_ab, "PREC": "tf32", **blocks}
        opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        ptrs = {"w_ptr": "*u8", "s_ptr": "*u8", "gs_ptr": "*fp32"}
        grouping = {"tok_ptr": "*i32", "blk_e_ptr": "*i32", "blk_rows_ptr": "*i32"}
        gate_up = {"x_ptr": f"*{mdt}", **ptrs, "rw_ptr": "*fp32", **grouping, "act_ptr": f"*{mdt}"}
        gate_up |= {a: "i32" for a in ("K", "N_INTER", "top_k")} | {"limit": "fp32"}
        gate_up |= {a: "i32" for a in ("stride_x", "stride_we", "stride_wn")}
        gate_up |= {a: "i32" for a in ("stride_se", "stride_sn")}
        down = {"act_ptr": f"*{mdt}", **ptrs, **grouping, "y_ptr": "*bf16", "K": "i32", "N": "i32"}
        down |= {a: "i32" for a in ("stride_we", "stride_wn", "stride_se", "stride_sn")}
        rep_gu = _sm90(
            triton_moe._gate_up_kernel, gate_up, {**common, "HAS_LIMIT": True, "ODT": odt}, opts
        )
        rep_dn = _sm90(triton_moe._down_kernel, down, common, opts)
        print(f"{cfg}\n    gate_up: {rep_gu}\n    down:    {rep_dn}", flush=True)


def main() -> None:
    if COMPILE:
        compile_report()
        return
    gen = torch.Generator().manual_seed(0)
    check_e2m1()
    check_grouping(gen)
    check_moe(gen)
    check_accuracy_against_fp64(gen)
    print("all interpreter checks passed")


if __name__ == "__main__":
    main()
