"""Check the Triton sparse MQA kernel without a GPU: numerics in Triton's interpreter, and
(--sm90) the resources of an ahead-of-time compile for the H200.

    TRITON_INTERPRET=1 .venv/bin/python scripts/dev_sparse_attention_interpret.py [--quick]
    .venv/bin/python scripts/dev_sparse_attention_interpret.py --sm90

Interpreter: each case draws fresh inputs (pools as strided views whose padding columns hold
NaN, -1 holes, all -1 rows, repeated indices, large sinks), poisons the output, and compares
with the float64 reference over the concatenated sources, for forced split counts and the
default. --sm90: compiles the split kernel for sm_90 with the launch's own specialization
(16-divisible arguments marked as the runtime marks them) and prints ptxas's registers,
spills and shared memory, and whether the products became wgmma instructions.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

from kvrelay.models.deepseek_v4.sparse_attention import sparse_attention

# (T, H, D, Ka, Kb or None): the tiny model's shapes, and small stand-ins for the real ones.
CASES = [
    (1, 4, 96, 16, 8),
    (5, 4, 96, 16, None),
    (5, 4, 96, 16, 0),
    (3, 4, 96, 0, 40),
    (4, 20, 64, 37, 70),
    (2, 64, 128, 32, 96),
    (2, 80, 32, 20, 30),  # two head blocks, the second partly masked
]


def make_inputs(t, h, d, ka, kb, dtype, idx_dtype, gen):
    """Random q, pools (views with a row stride and NaN padding), indices with holes."""

    def pool(m):
        base = torch.full((m, d + 24), float("nan"), dtype=dtype)
        base[:, :d] = torch.randn(m, d, generator=gen).to(dtype)
        return base[:, :d]

    def index(k, m):
        idx = torch.randint(0, m, (t, k), generator=gen)
        idx[torch.rand(t, k, generator=gen) < 0.3] = -1  # mixed holes
        if t > 1 and k > 0:
            idx[1] = -1  # a row with no entry in this source
        if k > 2:
            idx[:, 1] = idx[:, 0]  # repeated entries count twice
        return idx.to(idx_dtype)

    q = (torch.randn(t, h, d, generator=gen) * 2).to(dtype)
    ma, mb = 3 * max(ka, 1) + 5, 2 * max(kb or 0, 1) + 7
    kv_a, idx_a = pool(ma), index(ka, ma)
    kv_b, idx_b = (pool(mb), index(kb, mb)) if kb is not None else (None, None)
    sinks = torch.randn(h, generator=gen)
    sinks[::3] += 8.0  # some heads whose sink takes nearly all the mass
    return q, kv_a, idx_a, kv_b, idx_b, sinks


def reference(q, kv_a, idx_a, kv_b, idx_b, sinks, scale):
    if kv_b is None:
        kv, idx = kv_a, idx_a.long()
    else:
        shifted = torch.where(idx_b >= 0, idx_b.long() + kv_a.shape[0], -1)
        kv, idx = torch.cat((kv_a, kv_b)), torch.cat((idx_a.long(), shifted), 1)
    return sparse_attention(q.double(), kv.double(), idx, sinks.double(), scale)


def _patch_interpreter_for_numpy_2_4() -> None:
    # Triton 3.6's interpreter calls int() on 1-element arrays, which numpy >= 2.4 refuses
    # (triton-lang/triton#9171): runtime loop bounds such as range(start, end) then fail.
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


# (dtype, H, D, Ka, Kb, splits): the real model (CSA decode split / prefill direct), the tiny
# test model, 16 heads (TP4 of the real model), an fp32 oracle run.
SM90_CASES = [
    ("bf16", 64, 512, 128, 512, 4, {}),
    ("bf16", 64, 512, 128, 512, 1, {}),
    ("bf16", 64, 512, 128, 512, 4, {"DV_SPLIT": 2, "num_warps": 4}),
    ("bf16", 64, 512, 128, 512, 4, {"BLOCK_N": 64}),
    ("bf16", 4, 96, 16, 8, 2, {}),
    ("bf16", 16, 512, 128, 512, 2, {}),
    ("fp32", 64, 512, 128, 512, 2, {}),
]


def sm90_report() -> int:
    """Compile the split kernel ahead of time for sm_90 and print its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvrelay.kernels import triton_sparse_attention as k

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    fn = k._sparse_split_kernel
    names = fn.arg_names
    for dt, h, d, ka, kb, splits, override in SM90_CASES:
        torch_dt = torch.bfloat16 if dt == "bf16" else torch.float32
        cfg = {**k._split_config(torch_dt, h, d), **override}
        opts = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
        cfg["BLOCK_DV"] = cfg.pop("BLOCK_D") // cfg["DV_SPLIT"]
        chunk, _ = k._chunk_for(ka + kb, splits, cfg["BLOCK_N"])
        dot = k._dot_precision(torch_dt)
        consts = {"HEAD_DIM": d, "DIRECT": splits == 1, "ALIGNED": True, "DOT_PREC": dot, **cfg}
        # Runtime values of the integer arguments (pools with D + 32 row stride).
        ints = {"stride_qt": h * d, "stride_qh": d, "stride_kva": d + 32, "stride_ia": ka,
                "stride_kvb": d + 32, "stride_ib": kb, "stride_ot": h * d, "stride_oh": d,
                "num_heads": h, "len_a": ka, "len_b": kb, "chunk": chunk,
                "num_splits": splits}  # fmt: skip
        sig, attrs = {}, {}
        for i, name in enumerate(names):
            if name in consts:
                sig[name] = "constexpr"
            elif name in ints:
                sig[name] = "i32"
                if ints[name] % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif name == "qk_scale":
                sig[name] = "fp32"
            else:
                f32 = name in ("sinks_ptr", "part_o_ptr", "part_m_ptr", "part_l_ptr")
                sig[name] = "*i32" if "idx" in name else ("*fp32" if f32 else f"*{dt}")
                attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(
            fn=fn,
            signature=sig,
            constexprs={(names.index(n),): v for n, v in consts.items()},
            attrs=attrs,
        )
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        with tempfile.TemporaryDirectory() as tmp:
            ptx = os.path.join(tmp, "k.ptx")
            with open(ptx, "w") as f:
                f.write(ck.asm["ptx"])
            r = subprocess.run(
                [ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                capture_output=True,
                text=True,
            )
        info = " ".join(
            line.split("info    : ")[-1].strip()
            for line in r.stderr.splitlines()
            if "registers" in line or "spill" in line
        )
        mma = "wgmma" if "wgmma.mma_async" in ck.asm["ptx"] else (
            "mma.sync" if "mma.sync" in ck.asm["ptx"] else "fma")  # fmt: skip
        print(
            f"{dt} H={h} D={d} Ka={ka} Kb={kb} splits={splits} {cfg} {opts}: "
            f"shared {ck.metadata.shared} B, {mma}; {info}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="first two cases, fp32 only")
    p.add_argument("--sm90", action="store_true", help="ahead-of-time sm_90 resource report")
    args = p.parse_args(argv)
    if args.sm90:
        return sm90_report()
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    _patch_interpreter_for_numpy_2_4()
    from kvrelay.kernels.triton_sparse_attention import sparse_mqa

    gen = torch.Generator().manual_seed(0)
    # The interpreter runs bf16 dots on the raw uint16 bits (Triton 3.6): the low-precision
    # path is checked here in fp16; bf16 is covered by tests/gpu/test_triton_sparse_attention.py.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}
    cases = CASES[:2] if args.quick else CASES
    dtypes = (torch.float32,) if args.quick else (torch.float32, torch.float16)
    worst, failed = 0.0, 0
    for t, h, d, ka, kb in cases:
        for dtype in dtypes:
            for idx_dtype, dv in ((torch.int32, 1), (torch.int64, 1), (torch.int32, 2)):
                for splits in (None, 1, 2, 5):
                    q, kv_a, idx_a, kv_b, idx_b, sinks = make_inputs(
                        t, h, d, ka, kb, dtype, idx_dtype, gen
                    )
                    scale = d**-0.5
                    out = torch.full_like(q, float("nan"))
                    t0 = time.perf_counter()
                    cfg = {"DV_SPLIT": dv}
                    sparse_mqa(q, kv_a, idx_a, kv_b, idx_b, sinks, scale, splits, out, cfg)
                    dt = time.perf_counter() - t0
                    ref = reference(q, kv_a, idx_a, kv_b, idx_b, sinks, scale)
                    err = ((out.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
                    ok = bool(torch.isfinite(out).all()) and err < tol[dtype]
                    if t > 1:
                        ok = ok and bool((out[1] == 0).all())  # row 1: no entry at all
                    worst = max(worst, err) if dtype == torch.float32 else worst
                    failed += not ok
                    print(
                        f"{'ok  ' if ok else 'FAIL'} T={t} H={h} D={d} Ka={ka} Kb={kb} "
                        f"{str(dtype)[6:]:>7} {str(idx_dtype)[6:]} dv={dv} splits={splits} "
                        f"rel={err:.2e} ({dt:.1f}s)"
                    )
    print(f"{failed} failed; worst fp32 rel error {worst:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
