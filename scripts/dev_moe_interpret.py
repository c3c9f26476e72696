"""Checks the Triton fused MoE (kvrelay/kernels/triton_moe.py) on the CPU through Triton's
interpreter, against the torch reference `Experts.forward`: the grouping kernel against the
torch grouping, the e2m1 decode over all 16 codes, dense fp32/bf16 and NVFP4 experts on small
shapes, both operand orders. Slow (the interpreter), so shapes stay small.

    TRITON_INTERPRET=1 .venv/bin/python scripts/dev_moe_interpret.py
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (Triton's CPU interpreter)")

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
    b = tl.load(b_ptr + r).to(tl.int32)
    tl.store(lo_ptr + r, triton_moe._e2m1_small(b, False) * 16384.0)
    tl.store(hi_ptr + r, triton_moe._e2m1_small(b, True) * 16384.0)


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


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    check_e2m1()
    check_grouping(gen)
    check_moe(gen)
    print("all interpreter checks passed")


if __name__ == "__main__":
    main()
