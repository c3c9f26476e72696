"""DeepSeek-V4 against an independent float64 oracle, plus causality and chunking invariance.

The oracle below is written from the formulas in shared/reference/deepseek-v4.md with plain
per-position loops; it shares no code with kvrelay (it reads only the weights, by HF name). It
covers the path HF cannot check causally: the indexer really dropping entries (index_topk below
the number of visible entries), and the reference's QAT roundings (FP8 KV, Hadamard + FP4 index).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvrelay.models.deepseek_v4 import DeepseekV4ForCausalLM, init_dummy_weights, preset
from kvrelay.models.deepseek_v4.config import CSA, HASH_MOE, SLIDING, DeepseekV4Config

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops


# --------------------------------------------------------------------------------------------
# The oracle
# --------------------------------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean() + eps)
    return y if w is None else y * w


def _inv_freq(cfg: DeepseekV4Config, compressed: bool) -> torch.Tensor:
    dim = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freqs = torch.tensor([base ** (-2 * i / dim) for i in range(dim // 2)], dtype=F64)
    if not compressed or cfg.rope_factor <= 1:
        return freqs
    orig = cfg.rope_original_max_position

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(corr_dim(cfg.rope_beta_slow)), dim - 1)
    out = freqs.clone()
    for i in range(dim // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 1 -> interpolate (freq / factor)
        out[i] = freqs[i] / cfg.rope_factor * ramp + freqs[i] * (1 - ramp)
    return out


def _rope(v: torch.Tensor, pos: int, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*len(freqs) dims of a vector as pairs (2k, 2k+1)."""
    out = v.clone()
    base = v.shape[-1] - 2 * len(freqs)
    for k in range(len(freqs)):
        ang = pos * float(freqs[k])
        c, s = math.cos(ang), (-1 if inverse else 1) * math.sin(ang)
        a, b = v[base + 2 * k], v[base + 2 * k + 1]
        out[base + 2 * k], out[base + 2 * k + 1] = a * c - b * s, a * s + b * c
    return out


def _round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3fn value (3 mantissa bits, min normal 2^-6, max 448), ties to even."""
    e = torch.floor(torch.log2(v.abs().clamp(min=1e-300))).clamp(min=-6)
    step = torch.exp2(e - 3)
    return (torch.round(v / step) * step).clamp(-448, 448)


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value (0, .5, 1, 1.5, 2, 3, 4, 6), ties to even."""
    a = v.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(F64)
    return (torch.round(v / step) * step).clamp(-6, 6)


def _fake_quant(v: torch.Tensor, block: int, qmax: float, floor: float, rnd) -> torch.Tensor:
    out = v.clone()
    for b in range(0, v.shape[-1], block):
        blk = v[b : b + block]
        amax = max(float(blk.abs().max()), floor)
        scale = 2.0 ** math.ceil(math.log2(amax / qmax))  # ue8m0: a power of two
        out[b : b + block] = rnd(blk / scale) * scale
    return out


def _fp8(v: torch.Tensor) -> torch.Tensor:
    return _fake_quant(v, 64, 448.0, 1e-4, _round_e4m3)


def _fp4(v: torch.Tensor) -> torch.Tensor:
    return _fake_quant(v, 32, 6.0, 6.0 * 2.0**-126, _round_e2m1)


def _hadamard(v: torch.Tensor) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=F64)
    while h.shape[0] < v.shape[-1]:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h @ v / math.sqrt(v.shape[-1])


def _hc_weights(x: torch.Tensor, fn, base, scale, cfg: DeepseekV4Config):
    n = cfg.hc_mult
    f = x.flatten()
    mix = (fn @ f) / math.sqrt(float((f * f).mean()) + cfg.rms_norm_eps)
    pre = torch.sigmoid(mix[:n] * scale[0] + base[:n]) + cfg.hc_eps
    post = 2 * torch.sigmoid(mix[n : 2 * n] * scale[1] + base[n : 2 * n])
    c = torch.softmax((mix[2 * n :] * scale[2] + base[2 * n :]).view(n, n), dim=1) + cfg.hc_eps
    c = c / (c.sum(0, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        c = c / (c.sum(1, keepdim=True) + cfg.hc_eps)
        c = c / (c.sum(0, keepdim=True) + cfg.hc_eps)
    return pre, post, c


def _compress(x, w, prefix, cfg, ratio, dim, overlap, freqs, index: bool) -> list[torch.Tensor]:
    """Entries of every complete window of the T tokens."""
    eps, T = cfg.rms_norm_eps, x.shape[0]
    kv = [w[prefix + "kv_proj.weight"] @ x[t] for t in range(T)]
    ape = w[prefix + "position_bias"]
    sc = [w[prefix + "gate_proj.weight"] @ x[t] + ape[t % ratio] for t in range(T)]
    entries = []
    for win in range(T // ratio):
        slots_kv, slots_sc = [], []
        if overlap:
            for j in range(ratio):
                if win == 0:
                    slots_kv.append(torch.zeros(dim, dtype=F64))
                    slots_sc.append(torch.full((dim,), -math.inf, dtype=F64))
                else:
                    s = ratio * (win - 1) + j
                    slots_kv.append(kv[s][:dim])
                    slots_sc.append(sc[s][:dim])
            for j in range(ratio):
                s = ratio * win + j
                slots_kv.append(kv[s][dim:])
                slots_sc.append(sc[s][dim:])
        else:
            for j in range(ratio):
                slots_kv.append(kv[ratio * win + j])
                slots_sc.append(sc[ratio * win + j])
        weights = torch.softmax(torch.stack(slots_sc), dim=0)  # per channel, over the slots
        pooled = (weights * torch.stack(slots_kv)).sum(0)
        e = _rope(_rms(pooled, w[prefix + "kv_norm.weight"], eps), win * ratio, freqs)
        if cfg.qat_simulation:
            if index:
                e = _fp4(_hadamard(e))
            else:
                nope = dim - cfg.qk_rope_head_dim
                e = torch.cat((_fp8(e[:nope]), e[nope:]))
        entries.append(e)
    return entries


def _attention(h: torch.Tensor, w: dict, p: str, cfg: DeepseekV4Config, kind: str) -> torch.Tensor:
    T, H, hd, eps = h.shape[0], cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    nope, W = cfg.nope_head_dim, cfg.sliding_window
    freqs = _inv_freq(cfg, kind != SLIDING)
    qr, q, kv = [], [], []
    for t in range(T):
        qr_t = _rms(w[p + "q_a_proj.weight"] @ h[t], w[p + "q_a_norm.weight"], eps)
        heads = (w[p + "q_b_proj.weight"] @ qr_t).view(H, hd)
        q.append(torch.stack([_rope(_rms(heads[i], None, eps), t, freqs) for i in range(H)]))
        kv_t = _rope(_rms(w[p + "kv_proj.weight"] @ h[t], w[p + "kv_norm.weight"], eps), t, freqs)
        if cfg.qat_simulation:
            kv_t = torch.cat((_fp8(kv_t[:nope]), kv_t[nope:]))
        qr.append(qr_t)
        kv.append(kv_t)

    ratio = {SLIDING: 0, CSA: cfg.csa_compress_ratio}.get(kind, cfg.hca_compress_ratio)
    entries, index_keys = [], []
    if ratio:
        entries = _compress(h, w, p + "compressor.", cfg, ratio, hd, kind == CSA, freqs, False)
    if kind == CSA:
        ip, di, hi = p + "compressor.indexer.", cfg.index_head_dim, cfg.index_n_heads
        index_keys = _compress(h, w, ip, cfg, ratio, di, True, freqs, True)

    out = []
    for t in range(T):
        keys = [kv[s] for s in range(max(0, t - W + 1), t + 1)]
        n_vis = (t + 1) // ratio if ratio else 0
        if kind == CSA:
            qi = (w[ip + "q_b_proj.weight"] @ qr[t]).view(hi, di)
            qi = torch.stack([_rope(qi[i], t, freqs) for i in range(hi)])
            if cfg.qat_simulation:
                qi = torch.stack([_fp4(_hadamard(qi[i])) for i in range(hi)])
            hw = (w[ip + "scorer.weights_proj.weight"] @ h[t]) * di**-0.5 * hi**-0.5
            score = {
                j: sum(float(hw[i]) * max(0.0, float(qi[i] @ index_keys[j])) for i in range(hi))
                for j in range(n_vis)
            }
            chosen = sorted(score, key=lambda j: (-score[j], j))[: cfg.index_topk]
            keys += [entries[j] for j in chosen]
        elif ratio:
            keys += entries[:n_vis]
        k = torch.stack(keys)
        heads = []
        for i in range(H):
            logits = (k @ q[t][i]) * hd**-0.5
            sink = float(w[p + "sinks"][i])
            m = max(float(logits.max()), sink)
            e = torch.exp(logits - m)
            o = (e[:, None] * k).sum(0) / (e.sum() + math.exp(sink - m))
            heads.append(_rope(o, t, freqs, inverse=True))
        flat = torch.cat(heads)
        G, R = cfg.o_groups, cfg.o_lora_rank
        per = flat.shape[0] // G
        wo_a = w[p + "o_a_proj.weight"]
        mid = torch.cat(
            [wo_a[g * R : (g + 1) * R] @ flat[g * per : (g + 1) * per] for g in range(G)]
        )
        out.append(w[p + "o_b_proj.weight"] @ mid)
    return torch.stack(out)


def _moe(x: torch.Tensor, ids: torch.Tensor, w: dict, p: str, cfg: DeepseekV4Config, hashed: bool):
    lim, inter = cfg.swiglu_limit, cfg.moe_intermediate_size
    out = []
    for t in range(x.shape[0]):
        s = torch.sqrt(torch.log1p(torch.exp(w[p + "gate.weight"] @ x[t])))
        if hashed:
            idx = [int(e) for e in w[p + "gate.tid2eid"][int(ids[t])]]
        else:
            biased = s + w[p + "gate.e_score_correction_bias"]
            idx = sorted(range(len(s)), key=lambda e: -float(biased[e]))[: cfg.num_experts_per_tok]
        sel = torch.stack([s[e] for e in idx])
        weights = sel / sel.sum() * cfg.routed_scaling_factor
        y = torch.zeros_like(x[t])
        for e, we in zip(idx, weights, strict=True):
            gu = w[p + "experts.gate_up_proj"][e] @ x[t]
            g, u = gu[:inter].clamp(max=lim), gu[inter:].clamp(-lim, lim)
            y = y + w[p + "experts.down_proj"][e] @ (we * g * torch.sigmoid(g) * u)
        sp = p + "shared_experts."
        g = (w[sp + "gate_proj.weight"] @ x[t]).clamp(max=lim)
        u = (w[sp + "up_proj.weight"] @ x[t]).clamp(-lim, lim)
        out.append(y + w[sp + "down_proj.weight"] @ (g * torch.sigmoid(g) * u))
    return torch.stack(out)


def oracle_logits(weights: dict, cfg: DeepseekV4Config, ids: torch.Tensor) -> torch.Tensor:
    w = {k: (v.to(F64) if v.is_floating_point() else v) for k, v in weights.items()}
    T, n, eps = ids.shape[0], cfg.hc_mult, cfg.rms_norm_eps
    X = w["model.embed_tokens.weight"][ids][:, None, :].repeat(1, n, 1)
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        for sub in ("attn", "ffn"):
            hc = [w[f"{p}{sub}_hc.{k}"] for k in ("fn", "base", "scale")]
            mixes = [_hc_weights(X[t], *hc, cfg) for t in range(T)]
            norm = w[
                p + ("input_layernorm" if sub == "attn" else "post_attention_layernorm") + ".weight"
            ]
            h = torch.stack(
                [
                    _rms((pre[:, None] * X[t]).sum(0), norm, eps)
                    for t, (pre, _, _) in enumerate(mixes)
                ]
            )
            if sub == "attn":
                y = _attention(h, w, p + "self_attn.", cfg, cfg.layer_types[li])
            else:
                y = _moe(h, ids, w, p + "mlp.", cfg, cfg.mlp_layer_types[li] == HASH_MOE)
            X = torch.stack(
                [post[:, None] * y[t] + c.T @ X[t] for t, (_, post, c) in enumerate(mixes)]
            )
    logits = []
    for t in range(T):
        f = X[t].flatten()
        mix = (w["model.hc_head.hc_fn"] @ f) / math.sqrt(float((f * f).mean()) + eps)
        pre = (
            torch.sigmoid(mix * w["model.hc_head.hc_scale"] + w["model.hc_head.hc_base"])
            + cfg.hc_eps
        )
        u = _rms((pre[:, None] * X[t]).sum(0), w["model.norm.weight"], eps)
        logits.append(w["lm_head.weight"] @ u)
    return torch.stack(logits)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------
T_ORACLE = 100  # 25 ratio-4 entries (top-8 kept), 6 ratio-16 entries, window of 16 full


def _model(cfg: DeepseekV4Config, dtype: torch.dtype, seed: int = 0) -> DeepseekV4ForCausalLM:
    m = DeepseekV4ForCausalLM(cfg, dtype=dtype, with_mtp=False).eval()
    init_dummy_weights(m, seed)
    return m


def _ids(t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (t,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("qat", [True, False], ids=["qat", "no-qat"])
def test_matches_float64_oracle_with_topk_dropping(qat: bool) -> None:
    cfg = preset("dsv4-tiny").with_(qat_simulation=qat)
    assert cfg.index_topk < T_ORACLE // cfg.csa_compress_ratio  # the indexer really drops
    model = _model(cfg, F64)
    ids = _ids(T_ORACLE)
    got = model(ids)
    want = oracle_logits(model.state_dict(), cfg, ids)
    scale = want.abs().max().item()
    assert scale > 1.0
    assert (got - want).abs().max().item() <= 1e-9 * scale


def test_prefix_logits_equal_full_logits() -> None:
    """Causality: appending tokens never changes the logits of earlier positions."""
    cfg = preset("dsv4-tiny").with_(qat_simulation=False)
    model = _model(cfg, torch.float32)
    ids = _ids(200)
    full = model(ids)
    scale = full.abs().max().item()
    # every length around the window (16) and both ratios' boundaries, plus a spread
    lengths = sorted(
        {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65, 99, 128, 160, 199}
    )
    for n in lengths:
        assert (model(ids[:n]) - full[:n]).abs().max().item() <= 1e-5 * scale, n


def test_prefix_causality_with_qat_float64() -> None:
    # In fp32 the FP8/FP4 roundings amplify last-bit differences between matmul shapes; in fp64
    # the same code is exact to rounding, which shows the structure itself is causal.
    cfg = preset("dsv4-tiny")
    model = _model(cfg, F64)
    ids = _ids(160)
    full = model(ids)
    for n in (17, 33, 64, 97, 130):
        assert (model(ids[:n]) - full[:n]).abs().max().item() <= 1e-10 * full.abs().max().item()


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_incremental_equals_one_shot(chunk: int) -> None:
    cfg = preset("dsv4-tiny").with_(qat_simulation=False)
    model = _model(cfg, torch.float32)
    ids = _ids(150)
    full = model(ids)
    got = model.forward_chunked(ids, chunk)
    assert (got - full).abs().max().item() <= 1e-5 * full.abs().max().item()


def test_chunked_with_qat_float64_and_state_shapes() -> None:
    cfg = preset("dsv4-tiny")
    model = _model(cfg, F64)
    ids = _ids(150)
    full = model(ids)
    state, parts = model.new_state(), []
    for b, e in ((0, 5), (5, 6), (6, 40), (40, 41), (41, 150)):
        logits, state = model.forward_incremental(ids[b:e], state)
        parts.append(logits)
    assert (torch.cat(parts) - full).abs().max().item() <= 1e-10 * full.abs().max().item()

    assert state.num_tokens == 150
    for i, ls in enumerate(state.layers):
        assert ls.window.shape == (cfg.sliding_window - 1, cfg.head_dim)
        kind = cfg.layer_types[i]
        if kind == SLIDING:
            assert ls.compressor is None and ls.indexer is None
            continue
        r = cfg.compress_ratio(i)
        assert ls.compressor.entries.shape == (150 // r, cfg.head_dim)
        assert ls.compressor.pending_kv.shape[0] == 150 % r
        if kind == CSA:
            assert ls.indexer.entries.shape == (150 // r, cfg.index_head_dim)
            assert ls.compressor.prev_kv.shape == (r, cfg.head_dim)
            assert ls.indexer.prev_kv.shape == (r, cfg.index_head_dim)
        else:
            assert ls.indexer is None and ls.compressor.prev_kv is None


def test_qat_roundings_match_kvrelay_quant() -> None:
    """The model's private fp64-capable roundings are bit-identical to kvrelay.quant's on fp32."""
    fp4 = pytest.importorskip("kvrelay.quant.fp4")
    fp8 = pytest.importorskip("kvrelay.quant.fp8_block")
    from kvrelay.models.deepseek_v4 import qat

    g = torch.Generator().manual_seed(0)
    for scale in (1e-6, 1e-3, 1.0, 1e3):
        x = torch.randn(512, 128, generator=g) * scale
        assert torch.equal(qat.fake_quant_fp4(x), fp4.fake_quant_fp4(x))
        assert torch.equal(qat.fake_quant_fp8_ue8m0(x), fp8.fake_quant_fp8_ue8m0(x))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    assert torch.equal(qat.fake_quant_fp4(ties), fp4.fake_quant_fp4(ties))
    x64 = torch.randn(64, 128, generator=g, dtype=F64)
    assert torch.equal(qat.fake_quant_fp4(x64), torch.stack([_fp4(r) for r in x64]))
    assert torch.equal(qat.fake_quant_fp8_ue8m0(x64), torch.stack([_fp8(r) for r in x64]))
