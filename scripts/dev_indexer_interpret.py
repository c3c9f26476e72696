"""Check kvrelay.kernels.triton_indexer on the CPU in Triton's interpreter against the torch
reference (small shapes; the interpreter is slow). Not a CI test: run it by hand.

    TRITON_INTERPRET=1 .venv/bin/python scripts/dev_indexer_interpret.py [--quick]

The interpreter runs bf16 dots on raw bits and rounds fp32 -> bf16 by truncation (Triton 3.6),
so q here is fp32 or fp16; bf16 is covered by tests/gpu/test_triton_indexer.py.

    .venv/bin/python scripts/dev_indexer_interpret.py --compile

compiles the kernels for sm_90 without a GPU instead (Triton's bundled ptxas) and prints each
variant's registers, stack (spills), shared memory and Hopper MMA count (HGMMA in the SASS).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from kvrelay.kernels import triton_indexer as ti
from kvrelay.kernels.indexer_reference import (
    indexer_scores_reference,
    indexer_topk_reference,
    select_reference,
)

FP8 = torch.float8_e4m3fn
SELECT_CONFIGS = [
    {"BLOCK": 256, "RADIX_BITS": 4, "num_warps": 4},
    {"BLOCK": 1024, "RADIX_BITS": 8, "num_warps": 4},
]
CONFIGS = [
    {"BLOCK_N": 32, "KEYS_AS_A": False, "num_warps": 4, "num_stages": 2, "TILES": 3},
    {"BLOCK_N": 128, "KEYS_AS_A": True, "num_warps": 8, "num_stages": 2, "TILES": 1},
]


def make_inputs(
    gen: torch.Generator,
    n_entries: list[int],
    tokens_per_seq: list[int],
    h: int,
    d: int,
    dtype: torch.dtype,
    fp8: bool,
    mode: str,
    n_cols: int | None = None,
) -> dict:
    """A varlen batch: sequence b has n_entries[b] keys in shuffled pool rows (unused rows are
    NaN, columns past the entries -1 or a random row); each of its tokens sees a random prefix
    (0, < topk and full included). mode: "exact" small integers (every score exact in fp32 in
    any summation order, many exact ties), "float" gaussian, "zeros" gaussian with most keys
    scoring exactly 0 (every head's ReLU is 0)."""
    b_count = len(n_entries)
    n_cols = n_cols or max(n_entries)
    m = sum(n_entries) + 7
    perm = torch.randperm(m, generator=gen)
    key_rows = torch.full((b_count, n_cols), -1, dtype=torch.int64)
    used, first = [], 0
    for b, n in enumerate(n_entries):
        key_rows[b, :n] = perm[first : first + n]
        used.append(perm[first : first + n])
        first += n
        if b % 2:  # some padding columns hold a valid row instead of -1
            key_rows[b, n:] = torch.randint(0, m, (n_cols - n,), generator=gen)
    t_count = sum(tokens_per_seq)
    seq = torch.repeat_interleave(torch.arange(b_count), torch.tensor(tokens_per_seq))
    n_vis = torch.empty(t_count, dtype=torch.int64)
    for t in range(t_count):
        n = n_entries[seq[t]]
        r = torch.randint(0, 6, (1,), generator=gen).item()
        n_vis[t] = {0: 0, 1: n, 2: min(n, 3)}.get(
            r, torch.randint(0, n + 1, (1,), generator=gen).item()
        )

    if mode.startswith("exact"):
        q = torch.randint(-4, 5, (t_count, h, d), generator=gen).float()
        k = torch.randint(-4, 5, (m, d), generator=gen).float()
        if mode == "exact_zeros":  # q >= 0 and 80% of the keys <= 0: those score exactly 0
            q = q.abs()
            k = torch.where((torch.rand(m, generator=gen) < 0.8)[:, None], -k.abs(), k)
        w = torch.randint(-8, 9, (t_count, h), generator=gen).float() / 64
        scale = 2.0 ** torch.randint(-2, 2, (m,), generator=gen).float()  # keeps sums exact
    else:
        q = torch.randn(t_count, h, d, generator=gen)
        k = torch.randn(m, d, generator=gen)
        w = torch.randn(t_count, h, generator=gen) * (d**-0.5 * h**-0.5)
        scale = torch.rand(m, generator=gen) * 0.02 + 0.001
        if mode == "zeros":  # q >= 0 and 80% of the keys <= 0: those entries score exactly 0
            q = q.abs()
            neg = torch.rand(m, generator=gen) < 0.8
            k = torch.where(neg[:, None], -k.abs(), k)
    mask = torch.ones(m, dtype=torch.bool)
    for u in used:
        mask[u] = False
    if fp8 and not mode.startswith("exact"):
        k = k / scale[:, None]  # stored fp8 values; the pool multiplies the scale back
    k[mask] = float("nan")
    keys = k.to(FP8 if fp8 else dtype)
    key_scale = scale.float() if fp8 else None
    return {
        "q": q.to(dtype),
        "w": w.float(),
        "keys": keys,
        "key_scale": key_scale,
        "key_rows": key_rows,
        "seq_of_token": seq,
        "n_visible": n_vis,
    }


def same_sets(idx: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool((idx.sort(dim=1).values == ref.sort(dim=1).values).all())


def near_tie_sets(
    idx: torch.Tensor, ref: torch.Tensor, ref_scores: torch.Tensor, tol: float
) -> int:
    """Rows whose sets differ only by entries scored within tol of the row's K-th reference
    score (rounding-order differences); returns the number of such rows, raises on others."""
    bad = 0
    for t in range(idx.shape[0]):
        a = set(idx[t].tolist()) - {-1}
        r = set(ref[t].tolist()) - {-1}
        if a == r:
            continue
        kth = ref_scores[t, ref[t][ref[t] >= 0]].min()
        diff = torch.tensor(sorted(a ^ r))
        gap = (ref_scores[t, diff] - kth).abs().max()
        if len(a) != len(r) or gap > tol * max(1.0, kth.abs().item()):
            raise AssertionError(f"row {t}: sets differ beyond near-ties (gap {gap})")
        bad += 1
    return bad


def check_case(name: str, gen: torch.Generator, topk: int, **kw) -> None:
    t0 = time.time()
    x = make_inputs(gen, **kw)
    args = [x[a] for a in ("q", "w", "keys", "key_scale", "key_rows", "seq_of_token", "n_visible")]
    ref = indexer_topk_reference(*args, topk)
    ref_scores = indexer_scores_reference(*args)
    k = ref.shape[1]
    msgs = []
    for select in ("triton", "torch"):
        out = torch.full((x["q"].shape[0], k), -7, dtype=torch.int64)
        got = ti.indexer_topk(*args, topk, select=select, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert not (got == -7).any(), f"{name}/{select}: unwritten output"
        if kw["mode"].startswith("exact"):
            assert same_sets(got, ref), f"{name}/{select}: sets differ\n{got}\n{ref}"
            if select == "torch":
                assert torch.equal(got, ref), f"{name}/torch: order differs"
        else:
            n = near_tie_sets(got, ref, ref_scores, 1e-4)
            msgs.append(f"{select}: {n} near-tie rows")
    scores = ti.indexer_scores(*args)
    for cfg in CONFIGS:  # the other tile shapes and orientations give the same scores
        other = ti.indexer_scores(*args, config=cfg)
        assert torch.equal(torch.isneginf(other), torch.isneginf(scores)), f"{name}: {cfg}"
        if kw["mode"].startswith("exact"):
            assert torch.equal(other, scores), f"{name}: {cfg}"
        else:
            assert torch.allclose(other, scores, rtol=1e-5, atol=1e-6), f"{name}: {cfg}"
    vis = torch.isfinite(ref_scores)
    assert torch.equal(torch.isneginf(scores), torch.isneginf(ref_scores)), f"{name}: -inf mask"
    err = (scores[vis].double() - ref_scores[vis].double()).norm() / max(
        ref_scores[vis].double().norm(), 1e-30
    )
    if kw["mode"].startswith("exact"):
        assert torch.equal(scores[vis], ref_scores[vis].float()), f"{name}: exact scores differ"
    assert err < 1e-5, f"{name}: score rel err {err}"
    # Selection alone on the kernel's own scores is exact whatever the inputs.
    sel_ref = select_reference(scores, topk)
    assert same_sets(ti.topk_select(scores, x["n_visible"], topk), sel_ref), f"{name}: select"
    assert torch.equal(ti.topk_select_torch(scores, x["n_visible"], topk), sel_ref)
    zeros = int((ref_scores == 0).sum())
    # Rows where the K-th and (K+1)-th scores tie: the tie rule decides the set.
    srt = ref_scores.sort(dim=1, descending=True).values
    kth = srt[:, k - 1] if srt.shape[1] > k else srt[:, :0].sum(1)
    nxt = srt[:, k] if srt.shape[1] > k else kth
    ties = int(((kth == nxt) & torch.isfinite(kth)).sum()) if srt.shape[1] > k else 0
    print(f"ok {name}: T={len(x['n_visible'])} score_err={err:.1e} zeros={zeros} "
          f"boundary_ties={ties} "
          f"{' '.join(msgs)} ({time.time() - t0:.1f}s)", flush=True)  # fmt: skip


def check_select(gen: torch.Generator, t_count: int, n_cols: int, topk: int) -> None:
    """The selection alone on crafted scores: many exact ties, +-0.0, +-inf, NaN, varlen."""
    neg_nan = torch.tensor([-4194304], dtype=torch.int32).view(torch.float32)  # 0xFFC00000
    vals = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")])
    vals = torch.cat([vals, neg_nan])
    pick = torch.randint(0, len(vals) + 3, (t_count, n_cols), generator=gen)
    rnd = torch.randn(t_count, n_cols, generator=gen).round(decimals=1)
    s = torch.where(pick < len(vals), vals[pick.clamp(max=len(vals) - 1)], rnd)
    s[0] = 0.0  # one row of all ties
    s[1] = torch.where(torch.arange(n_cols) % 2 == 0, -0.0, 0.0)  # -0.0 ties +0.0
    s[2, : n_cols // 2] = torch.where(torch.arange(n_cols // 2) % 2 == 0, float("nan"), neg_nan)
    n_vis = torch.randint(0, n_cols + 1, (t_count,), generator=gen)
    n_vis[:4] = torch.tensor([n_cols, n_cols, n_cols, 0])
    n_vis[4] = min(topk - 1, n_cols)
    # Row 5: exactly topk values in [2, 4), 2.0 among them, the rest 0.3: the radix select is
    # done after its first digit, and the key of 2.0 equals the picked prefix.
    top = torch.randperm(n_cols, generator=gen)[:topk]
    s[5] = 0.3
    s[5, top] = 2.0 + torch.randint(0, 4, (topk,), generator=gen).float() / 2
    s[5, top[0]] = 2.0
    n_vis[5] = n_cols
    masked = s.masked_fill(torch.arange(n_cols)[None, :] >= n_vis[:, None], float("-inf"))
    ref = select_reference(masked, topk)
    # Garbage past n_visible must not matter.
    junk = torch.where(torch.arange(n_cols)[None, :] >= n_vis[:, None], float("nan"), s)
    got = ti.topk_select(junk, n_vis, topk)
    assert same_sets(got, ref), f"select {t_count}x{n_cols} k={topk}:\n{got}\n{ref}"
    for cfg in SELECT_CONFIGS:  # other digit widths and chunk sizes: the same sets
        out = torch.full_like(ref, -7)
        ti._launch_select(junk, n_vis, ref.shape[1], out, cfg)
        assert same_sets(out, ref), f"select {t_count}x{n_cols} k={topk} {cfg}"
    assert torch.equal(ti.topk_select_torch(junk, n_vis, topk), ref)
    print(f"ok select T={t_count} N={n_cols} topk={topk}", flush=True)


def check_visible_minus_one(gen: torch.Generator) -> None:
    """A -1 pool row inside the visible range reads row 0, as the reference does."""
    x = make_inputs(gen, [30, 20], [3, 3], 4, 32, torch.float32, False, "exact", n_cols=40)
    x["keys"][0] = 1.0  # row 0 must be finite for the comparison
    x["n_visible"][:] = 40
    args = [x[a] for a in ("q", "w", "keys", "key_scale", "key_rows", "seq_of_token", "n_visible")]
    ref = indexer_topk_reference(*args, 8)
    assert same_sets(ti.indexer_topk(*args, 8), ref)
    # Columns past sequence 1's entries may read unused (NaN) rows: NaN on both sides.
    torch.testing.assert_close(
        ti.indexer_scores(*args), indexer_scores_reference(*args), rtol=0, atol=0, equal_nan=True
    )
    print("ok visible -1 rows", flush=True)


def _patch_interpreter_for_numpy_2_4() -> None:
    # Triton 3.6's interpreter calls int() on 1-element arrays, which numpy >= 2.4 refuses
    # (triton-lang/triton#9171): runtime loop bounds such as range(0, n) then fail. The same
    # patch as tests/kernels/test_triton_attention_interp.py.
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def _sm90_report(fn, sig: dict[str, str], const: dict, divisible: list[str], opts: dict) -> str:
    """Compile fn for sm_90 and summarize its cubin: REG, STACK, SHARED, HGMMA count."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    k = triton.compile(ASTSource(fn, sig, const, attrs), GPUTarget("cuda", 90, 32), opts)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    regs, stack = m.groups() if m else ("?", "?")
    return f"regs={regs} stack={stack} shared={k.metadata.shared} HGMMA={sass.count('HGMMA')}"


def compile_report() -> None:
    """Every score-kernel variant the tests and the benchmark sweep use, and the select
    kernels, compiled for sm_90."""
    import triton

    score_sig = {
        **{a: "*i32" for a in ("q_ptr", "w_ptr", "k_ptr", "ks_ptr", "rows_ptr")},
        **{"seq_ptr": "*i32", "nvis_ptr": "*i32", "s_ptr": "*fp32"},
        **{a: "i32" for a in ("n_cols", "span", "stride_qt", "stride_qh", "stride_wt")},
        **{a: "i32" for a in ("stride_km", "stride_rb", "stride_st")},
        **{a: "constexpr" for a in ("H", "H_PAD", "D", "BLOCK_N", "FP8", "DOT_PREC")},
        "KEYS_AS_A": "constexpr",
    }
    div = ["q_ptr", "w_ptr", "k_ptr", "ks_ptr", "rows_ptr", "seq_ptr", "nvis_ptr", "s_ptr"]
    div += ["stride_qt", "stride_qh", "stride_km", "stride_rb", "stride_st"]
    for qdt in ("bf16", "fp32"):
        for fp8 in (False, True):
            for h, d in ((4, 32), (16, 64), (64, 128)):
                for cfg in [ti._score_config(h, d), *CONFIGS]:
                    cfg = dict(cfg)
                    cfg.pop("TILES", None)
                    opts = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
                    sig = dict(score_sig, q_ptr=f"*{qdt}", w_ptr="*fp32", ks_ptr="*fp32")
                    sig["k_ptr"] = "*fp8e4nv" if fp8 else f"*{qdt}"
                    const = {"H": h, "H_PAD": max(16, triton.next_power_of_2(h)), "D": d,
                             "FP8": fp8, "DOT_PREC": "ieee" if qdt == "fp32" else "tf32", **cfg}  # fmt: skip
                    rep = _sm90_report(ti._score_kernel, sig, const, div, opts)
                    print(
                        f"score {qdt} {'fp8' if fp8 else 'plain'} h={h} d={d} {cfg} {opts}: {rep}"
                    )
    sel_sig = {"s_ptr": "*fp32", "nvis_ptr": "*i32", "out_ptr": "*i64"}
    sel_sig.update({a: "i32" for a in ("n_cols", "k", "stride_st", "stride_ot")})
    sel_sig.update({a: "constexpr" for a in ("BLOCK", "K_BLOCK", "RADIX_BITS")})
    extra = [{"BLOCK": 8192, "RADIX_BITS": r, "num_warps": w} for r in (4, 8) for w in (16, 32)]
    for n_cols in (40, 1024, 4096, 16384):
        for cfg in [ti._select_config(n_cols, 512), *SELECT_CONFIGS, *extra]:
            cfg = dict(cfg)
            opts = {"num_warps": cfg.pop("num_warps")}
            const = {"K_BLOCK": 512, **cfg}
            rep = _sm90_report(ti._select_kernel, sel_sig, const, ["s_ptr", "out_ptr"], opts)
            print(f"select N={n_cols} {cfg} {opts}: {rep}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="skip the larger shapes")
    p.add_argument("--compile", action="store_true", help="compile for sm_90 and report")
    args = p.parse_args()
    if args.compile:
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("--compile needs TRITON_INTERPRET unset", file=sys.stderr)
            return 1
        compile_report()
        return 0
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 1
    _patch_interpreter_for_numpy_2_4()
    gen = torch.Generator().manual_seed(0)
    check_select(gen, 6, 40, 8)
    check_select(gen, 6, 700, 64)
    check_select(gen, 6, 5000, 512)  # several BLOCK chunks per pass
    check_visible_minus_one(gen)
    tiny = {"n_entries": [40, 13, 1, 0], "tokens_per_seq": [5, 4, 2, 2], "h": 4, "d": 32}
    for dtype in (torch.float32, torch.float16):
        for fp8 in (False, True):
            for mode in ("exact", "exact_zeros", "zeros", "float"):
                tag = f"tiny-{str(dtype)[6:]}-{'fp8' if fp8 else 'plain'}-{mode}"
                check_case(tag, gen, 8, dtype=dtype, fp8=fp8, mode=mode, **tiny)
    mid = {"n_entries": [300, 77, 5], "tokens_per_seq": [4, 3, 2], "h": 12, "d": 64}
    for mode in ("exact", "exact_zeros", "zeros", "float"):
        check_case(f"mid-fp32-{mode}", gen, 32, dtype=torch.float32, fp8=False, mode=mode, **mid)
    check_case("mid-fp16-fp8-exact", gen, 32, dtype=torch.float16, fp8=True, mode="exact", **mid)
    # Extra columns past every sequence's entries, and topk > N.
    check_case("wide-cols", gen, 64, dtype=torch.float32, fp8=False, mode="exact",
               n_entries=[20, 9], tokens_per_seq=[3, 3], h=4, d=32, n_cols=50)  # fmt: skip
    # Row blocks: a scratch smaller than T x N forces several launches.
    saved = ti._SCRATCH_ELEMS
    ti._SCRATCH_ELEMS = 40 * 3
    check_case("row-blocks", gen, 8, dtype=torch.float32, fp8=False, mode="exact", **tiny)
    ti._SCRATCH_ELEMS = saved
    if not args.quick:
        real = {"n_entries": [1100, 600], "tokens_per_seq": [2, 2], "h": 64, "d": 128}
        for mode in ("exact", "exact_zeros", "zeros", "float"):
            check_case(
                f"real-fp32-{mode}", gen, 512, dtype=torch.float32, fp8=False, mode=mode, **real
            )
        check_case(
            "real-fp16-fp8-zeros", gen, 512, dtype=torch.float16, fp8=True, mode="zeros", **real
        )
    print("all interpreter checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
