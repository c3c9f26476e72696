"""DeepSeek-V4 against HF transformers' DeepseekV4ForCausalLM on the same checkpoint.

One random `dsv4-tiny` checkpoint (HF names, fp32) is written to a temporary directory with its
config.json and loaded by both implementations. HF does not simulate the reference's QAT
roundings, so kvrelay runs with qat_simulation off here (the float64 oracle test covers them).

Why HF is not causal when the indexer drops entries (transformers 5.24): its indexer takes
`torch.topk` over a row holding *every* compressed entry of the forward call, the future ones
masked to -inf. An index score is sum_h w_h * ReLU(q_h . k_j), which is exactly 0.0 whenever
all heads' dot products are negative, so exact ties are common (with few index heads, very
common). torch.topk leaves the order of equal values unspecified, and in practice it changes
with the row length: appending tokens adds entries to the row and changes which of the tied
entries token t keeps, hence its logits. Cached generation builds rows of yet another length
(only the entries emitted so far), so it agrees with neither. Nothing else in HF's forward is
non-causal: with no ties at the top-k boundary the three agree (and agree with kvrelay).
kvrelay breaks ties towards the lower entry index (stable sort), which depends only on the
visible entries, so its logits are causal and identical under any chunking.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from dsv4_hf import hf_logits, load_hf
from safetensors.torch import load_file, save_file

from kvrelay.models.deepseek_v4 import (
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    init_dummy_weights,
    preset,
)
from kvrelay.models.deepseek_v4.config import CSA, HCA, SLIDING
from kvrelay.models.deepseek_v4.indexer import Indexer

T = 256  # 64 ratio-4 entries, 16 ratio-16 entries, the 16-token window full many times over


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops


def _write_checkpoint(path: Path, cfg: DeepseekV4Config, seed: int) -> None:
    """config.json + model.safetensors with HF names (and the MTP block, which HF ignores)."""
    model = DeepseekV4ForCausalLM(cfg)
    init_dummy_weights(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _load_ours(path: Path) -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4Config.from_dict(json.loads((path / "config.json").read_text()))
    model = DeepseekV4ForCausalLM(cfg.with_(qat_simulation=False)).eval()
    model.load_hf_state_dict(load_file(str(path / "model.safetensors")))
    return model


def _ids(shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # index_topk 64 >= the 64 entries of T tokens: the regime where HF's forward is causal
    path = tmp_path_factory.mktemp("dsv4_tiny")
    _write_checkpoint(path, preset("dsv4-tiny").with_(qat_simulation=False, index_topk=64), 0)
    return path


def _variant(base: Path, tmp: Path, **changes) -> Path:
    """Same weights, another config.json."""
    tmp.mkdir()
    d = json.loads((base / "config.json").read_text()) | changes
    (tmp / "config.json").write_text(json.dumps(d))
    (tmp / "model.safetensors").symlink_to(base / "model.safetensors")
    return tmp


def test_logits_match_hf(ckpt: Path) -> None:
    ours, hf = _load_ours(ckpt), load_hf(ckpt)
    ids = _ids((2, T))
    got, want = ours(ids), hf_logits(hf, ids)
    scale = want.abs().max().item()
    assert scale > 1.0
    assert (got - want).abs().max().item() <= 1e-4 * scale


def _capture_index_scores(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    rows: list[torch.Tensor] = []
    original = Indexer.scores

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        rows.append(out.detach().clone())
        return out

    monkeypatch.setattr(Indexer, "scores", spy)
    return rows


def _boundary_ties(scores: torch.Tensor, k: int) -> int:
    """Rows whose k-th best visible score equals the next one (the selection is then a tie-break)."""
    vis = torch.sort(scores, dim=-1, descending=True).values
    if vis.shape[1] <= k:
        return 0
    kth, nxt = vis[:, k - 1], vis[:, k]
    return int(((kth == nxt) & torch.isfinite(nxt)).sum())


def test_logits_match_hf_when_indexer_drops_entries(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 16 index heads and this seed no exact tie sits at the top-8 boundary, so the
    choice is unambiguous and HF and kvrelay agree although most entries are dropped."""
    path = _variant(ckpt, tmp_path / "top8", index_topk=8)
    ours, hf = _load_ours(path), load_hf(path)
    rows = _capture_index_scores(monkeypatch)
    ids = _ids((T,))
    got, want = ours(ids), hf_logits(hf, ids)
    assert rows and all(_boundary_ties(r, 8) == 0 for r in rows)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_topk_ties_hf_non_causal_ours_causal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two index heads make exact-zero ties frequent. HF's selection for token t then depends
    on the sequence length; every difference between its full and prefix selections is a swap
    among entries of equal score. kvrelay keeps the lowest-index tied entries and is causal."""
    cfg = preset("dsv4-tiny").with_(qat_simulation=False, index_n_heads=2, index_topk=8)
    path = tmp_path / "ties"
    _write_checkpoint(path, cfg, seed=3)
    ours, hf = _load_ours(path), load_hf(path)
    ids, cut = _ids((T,)), 120

    # -- HF: record scores and selections of the first CSA layer, full and prefix
    first_csa = cfg.layer_types.index(CSA)
    indexer = hf.model.layers[first_csa].self_attn.compressor.indexer
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [
        indexer.scorer.register_forward_hook(lambda m, a, out: seen.append(("s", out[0]))),
        indexer.register_forward_hook(lambda m, a, out: seen.append(("i", out[0]))),
    ]
    full_hf, prefix_hf = hf_logits(hf, ids), hf_logits(hf, ids[:cut])
    for h in hooks:
        h.remove()
    (_, s_full), (_, i_full), (_, _), (_, i_pre) = seen
    changed = 0
    for t in range(cut):
        a = {int(j) for j in i_full[t] if j >= 0}
        b = {int(j) for j in i_pre[t] if j >= 0}
        if a != b:
            changed += 1
            kth = min(float(s_full[t, j]) for j in a | b)
            assert all(float(s_full[t, j]) == kth for j in a ^ b), t  # only tied entries swap
    hf_gap = (full_hf[:cut] - prefix_hf).abs().max().item()
    if transformers.__version__.startswith("5.24."):
        assert changed > 0 and hf_gap > 1e-3 * full_hf.abs().max().item()

    # -- kvrelay: causal, and each selection is "best score first, lower index on ties"
    rows = _capture_index_scores(monkeypatch)
    selections: list[torch.Tensor] = []
    original_select = Indexer.select

    def spy_select(self, *args, **kwargs):
        out = original_select(self, *args, **kwargs)
        selections.append(out)
        return out

    monkeypatch.setattr(Indexer, "select", spy_select)
    full = ours(ids)
    prefix = ours(ids[:cut])
    assert (full[:cut] - prefix).abs().max().item() <= 1e-5 * full.abs().max().item()
    assert sum(_boundary_ties(r, 8) for r in rows) > 0  # the tie-break really mattered
    for scores, chosen in zip(rows, selections, strict=True):
        for t in range(0, scores.shape[0], 7):
            vis = [j for j in range(scores.shape[1]) if torch.isfinite(scores[t, j])]
            want = sorted(vis, key=lambda j: (-float(scores[t, j]), j))[:8]
            assert [int(j) for j in chosen[t] if j >= 0] == want


def test_hf_checkpoint_without_mtp_loads(ckpt: Path) -> None:
    hf = load_hf(ckpt)
    ours = _load_ours(ckpt)  # the file carries model.mtp.0.*, which HF ignored
    file = load_file(str(ckpt / "model.safetensors"))
    mtp = [k for k in file if k.startswith("model.mtp.0.")]
    assert "model.mtp.0.e_proj.weight" in mtp and "model.mtp.0.hc_head.hc_fn" in mtp
    assert all(torch.equal(ours.state_dict()[k], file[k]) for k in mtp)
    again = DeepseekV4ForCausalLM(ours.config)
    again.load_hf_state_dict(hf.state_dict())  # HF's own state dict: no MTP block
    ids = _ids((40,))
    assert torch.allclose(again(ids), ours(ids), atol=1e-5)
    logits, mtp_logits = ours.forward_with_mtp(ids)
    assert mtp_logits.shape == (39, ours.config.vocab_size) and torch.isfinite(mtp_logits).all()


# --------------------------------------------------------------------------------------------
# Config parsing
# --------------------------------------------------------------------------------------------
def test_config_roundtrips_through_hf() -> None:
    for name in ("dsv4-tiny", "dsv4-mini", "dsv4-mini8", "dsv4-flash"):
        cfg = preset(name).with_(expert_format="dense")  # a serving choice, not in HF's config
        hf_cfg = transformers.DeepseekV4Config(**cfg.to_hf_dict())
        assert DeepseekV4Config.from_dict(hf_cfg.to_dict()) == cfg


def test_flash_config_json_forms() -> None:
    flash = preset("dsv4-flash").with_(expert_format="dense")  # not part of config.json
    ratios = [0, 0] + [4, 128] * 20 + [4, 0]  # 43 layers + the MTP slot
    hf_json = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
        "moe_intermediate_size": 2048, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0, "hidden_act": "silu", "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 512, "sliding_window": 128, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1,
        "compress_ratios": ratios, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 1,
    }  # fmt: skip
    native_json = {
        "vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43,
        "n_hash_layers": 3, "n_heads": 64, "n_routed_experts": 256, "n_shared_experts": 1,
        "n_activated_experts": 6, "score_func": "sqrtsoftplus", "route_scale": 1.5,
        "swiglu_limit": 10.0, "q_lora_rank": 1024, "head_dim": 512, "rope_head_dim": 64,
        "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "compress_ratios": ratios,
        "compress_rope_theta": 160000.0, "rope_theta": 10000.0, "rope_factor": 16,
        "original_seq_len": 65536, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 64,
        "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "norm_eps": 1e-6, "dtype": "fp8", "expert_dtype": "fp4",
    }  # fmt: skip
    assert DeepseekV4Config.from_dict(hf_json) == flash
    assert DeepseekV4Config.from_dict(transformers.DeepseekV4Config(**hf_json).to_dict()) == flash
    assert DeepseekV4Config.from_dict(native_json) == flash
    assert 280e9 < flash.num_params < 290e9  # "284B total"


def test_presets_cover_every_layer_kind() -> None:
    tiny, mini = preset("dsv4-tiny"), preset("dsv4-mini")
    assert {SLIDING, CSA, HCA} <= set(tiny.layer_types)
    assert 0 < tiny.num_hash_layers < tiny.num_hidden_layers
    assert tiny.sliding_window <= 16 and tiny.index_topk < T // tiny.csa_compress_ratio
    assert T // tiny.hca_compress_ratio >= 4
    assert mini.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA) and mini.num_hidden_layers == 20
    assert mini.hca_compress_ratio == 128 and mini.csa_compress_ratio == 4
    with pytest.raises(ValueError):
        preset("dsv4-huge")
