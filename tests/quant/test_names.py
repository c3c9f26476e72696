from __future__ import annotations

import pytest

from kvrelay.quant import (
    ExpertSlot,
    UnmappedNameError,
    expert_slot,
    hf_expert_to_native,
    hf_to_native,
    native_to_hf,
    scale_name_for,
    scale_names_for,
    weight_name_for_scale,
)

# Written by hand from reference §6 names and the transformers 5.24 "deepseek_v4" rename map.
KNOWN = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "layers.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    "layers.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
    "layers.0.hc_attn_fn": "model.layers.0.attn_hc.fn",
    "layers.0.hc_attn_base": "model.layers.0.attn_hc.base",
    "layers.0.hc_attn_scale": "model.layers.0.attn_hc.scale",
    "layers.0.hc_ffn_fn": "model.layers.0.ffn_hc.fn",
    "layers.0.hc_ffn_scale": "model.layers.0.ffn_hc.scale",
    "layers.0.attn.wq_a.weight": "model.layers.0.self_attn.q_a_proj.weight",
    "layers.0.attn.wq_a.scale": "model.layers.0.self_attn.q_a_proj.weight_scale_inv",
    "layers.0.attn.q_norm.weight": "model.layers.0.self_attn.q_a_norm.weight",
    "layers.0.attn.wq_b.weight": "model.layers.0.self_attn.q_b_proj.weight",
    "layers.0.attn.wkv.scale": "model.layers.0.self_attn.kv_proj.weight_scale_inv",
    "layers.0.attn.kv_norm.weight": "model.layers.0.self_attn.kv_norm.weight",
    "layers.0.attn.wo_a.weight": "model.layers.0.self_attn.o_a_proj.weight",
    "layers.0.attn.wo_b.scale": "model.layers.0.self_attn.o_b_proj.weight_scale_inv",
    "layers.0.attn.attn_sink": "model.layers.0.self_attn.sinks",
    "layers.0.ffn.gate.weight": "model.layers.0.mlp.gate.weight",
    "layers.0.ffn.gate.tid2eid": "model.layers.0.mlp.gate.tid2eid",
    "layers.3.ffn.gate.bias": "model.layers.3.mlp.gate.e_score_correction_bias",
    "layers.3.ffn.shared_experts.w1.weight": "model.layers.3.mlp.shared_experts.gate_proj.weight",
    "layers.3.ffn.shared_experts.w2.scale": "model.layers.3.mlp.shared_experts.down_proj.weight_scale_inv",
    "layers.3.ffn.shared_experts.w3.weight": "model.layers.3.mlp.shared_experts.up_proj.weight",
    "layers.3.attn.compressor.wkv.weight": "model.layers.3.self_attn.compressor.kv_proj.weight",
    "layers.3.attn.compressor.wgate.weight": "model.layers.3.self_attn.compressor.gate_proj.weight",
    "layers.3.attn.compressor.ape": "model.layers.3.self_attn.compressor.position_bias",
    "layers.3.attn.compressor.norm.weight": "model.layers.3.self_attn.compressor.kv_norm.weight",
    "layers.42.attn.indexer.wq_b.weight": "model.layers.42.self_attn.compressor.indexer.q_b_proj.weight",
    "layers.42.attn.indexer.wq_b.scale": "model.layers.42.self_attn.compressor.indexer.q_b_proj.weight_scale_inv",
    "layers.42.attn.indexer.weights_proj.weight": "model.layers.42.self_attn.compressor.indexer.scorer.weights_proj.weight",
    "layers.42.attn.indexer.compressor.wkv.weight": "model.layers.42.self_attn.compressor.indexer.kv_proj.weight",
    "layers.42.attn.indexer.compressor.wgate.weight": "model.layers.42.self_attn.compressor.indexer.gate_proj.weight",
    "layers.42.attn.indexer.compressor.ape": "model.layers.42.self_attn.compressor.indexer.position_bias",
    "layers.42.attn.indexer.compressor.norm.weight": "model.layers.42.self_attn.compressor.indexer.kv_norm.weight",
}


@pytest.mark.parametrize(("native", "hf"), list(KNOWN.items()))
def test_known_names_both_ways(native: str, hf: str) -> None:
    assert native_to_hf(native) == hf
    assert hf_to_native(hf) == native


def test_routed_experts_fuse() -> None:
    assert (
        native_to_hf("layers.7.ffn.experts.255.w1.weight")
        == "model.layers.7.mlp.experts.gate_up_proj"
    )
    assert (
        native_to_hf("layers.7.ffn.experts.3.w3.scale")
        == "model.layers.7.mlp.experts.gate_up_proj_scale_inv"
    )
    assert (
        native_to_hf("layers.7.ffn.experts.3.w2.weight") == "model.layers.7.mlp.experts.down_proj"
    )
    assert expert_slot("layers.7.ffn.experts.3.w1.weight") == ExpertSlot(
        "model.layers.7.mlp.experts.gate_up_proj", expert=3, part=0, parts=2
    )
    assert expert_slot("layers.7.ffn.experts.3.w3.scale") == ExpertSlot(
        "model.layers.7.mlp.experts.gate_up_proj_scale_inv", expert=3, part=1, parts=2
    )
    assert expert_slot("layers.7.ffn.experts.9.w2.scale") == ExpertSlot(
        "model.layers.7.mlp.experts.down_proj_scale_inv", expert=9, part=0, parts=1
    )
    assert expert_slot("layers.7.ffn.shared_experts.w1.weight") is None
    assert hf_expert_to_native("model.layers.7.mlp.experts.gate_up_proj", 5) == (
        "layers.7.ffn.experts.5.w1.weight",
        "layers.7.ffn.experts.5.w3.weight",
    )
    assert hf_expert_to_native("model.layers.7.mlp.experts.down_proj_scale_inv", 0) == (
        "layers.7.ffn.experts.0.w2.scale",
    )
    with pytest.raises(UnmappedNameError, match="hf_expert_to_native"):
        hf_to_native("model.layers.7.mlp.experts.gate_up_proj")
    with pytest.raises(UnmappedNameError):
        hf_expert_to_native("model.layers.7.mlp.gate.weight", 0)


@pytest.mark.parametrize(
    "name",
    [
        "mtp.0.e_proj.weight",  # HF has no MTP module
        "mtp.0.ffn.experts.0.w1.weight",
        "layers.5.ffn.experts.0.w1.weight_scale",  # NVFP4: no HF counterpart
        "layers.5.ffn.experts.0.w2.weight_scale_2",
        "layers.5.ffn.experts.0.w3.input_scale",
        "layers.5.attn.wq_a.bias",
        "layers.x.attn.wq_a.weight",
        "layers.5.attn.nonsense.weight",
        "model.layers.0.self_attn.q_a_proj.weight",  # already an HF name
        "",
    ],
)
def test_unmapped_native_names(name: str) -> None:
    with pytest.raises(UnmappedNameError):
        native_to_hf(name)


@pytest.mark.parametrize(
    "name",
    [
        "layers.0.attn.wq_a.weight",
        "model.layers.0.self_attn.q_a_proj.bias",
        "model.foo",
        "lm_head.scale",
    ],
)
def test_unmapped_hf_names(name: str) -> None:
    with pytest.raises(UnmappedNameError):
        hf_to_native(name)


def test_scale_names() -> None:
    w = "layers.3.ffn.experts.7.w1.weight"
    assert scale_name_for("layers.3.attn.wq_a.weight", "fp8_block") == "layers.3.attn.wq_a.scale"
    assert scale_name_for(w, "mxfp4") == "layers.3.ffn.experts.7.w1.scale"
    assert scale_name_for(w, "nvfp4") == "layers.3.ffn.experts.7.w1.weight_scale"
    assert scale_names_for(w, "nvfp4") == {
        "weight_scale": "layers.3.ffn.experts.7.w1.weight_scale",
        "weight_scale_2": "layers.3.ffn.experts.7.w1.weight_scale_2",
        "input_scale": "layers.3.ffn.experts.7.w1.input_scale",
    }
    hf = "model.layers.3.self_attn.q_a_proj.weight"
    assert scale_name_for(hf, "hf") == "model.layers.3.self_attn.q_a_proj.weight_scale_inv"
    fused = "model.layers.3.mlp.experts.gate_up_proj"
    assert scale_name_for(fused, "hf") == "model.layers.3.mlp.experts.gate_up_proj_scale_inv"
    # The scale's HF name is the HF name of the native scale.
    assert native_to_hf(scale_name_for("layers.3.attn.wq_a.weight", "fp8_block")) == scale_name_for(
        native_to_hf("layers.3.attn.wq_a.weight"), "hf"
    )
    with pytest.raises(ValueError):
        scale_name_for("layers.3.attn.attn_sink", "fp8_block")
    with pytest.raises(ValueError):
        scale_name_for(w, "int4")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("scale", "weight"),
    [
        ("layers.3.attn.wq_a.scale", "layers.3.attn.wq_a.weight"),
        ("layers.3.ffn.experts.7.w1.weight_scale", "layers.3.ffn.experts.7.w1.weight"),
        ("layers.3.ffn.experts.7.w1.weight_scale_2", "layers.3.ffn.experts.7.w1.weight"),
        ("layers.3.ffn.experts.7.w1.input_scale", "layers.3.ffn.experts.7.w1.weight"),
        (
            "model.layers.3.self_attn.q_a_proj.weight_scale_inv",
            "model.layers.3.self_attn.q_a_proj.weight",
        ),
        ("model.layers.3.mlp.experts.down_proj_scale_inv", "model.layers.3.mlp.experts.down_proj"),
        # mHC parameters are not quantization scales.
        ("model.layers.3.attn_hc.scale", None),
        ("model.layers.3.ffn_hc.scale", None),
        ("layers.3.hc_attn_scale", None),
        ("hc_head_scale", None),
        ("model.hc_head.hc_scale", None),
        ("layers.3.attn.wq_a.weight", None),
    ],
)
def test_weight_name_for_scale(scale: str, weight: str | None) -> None:
    assert weight_name_for_scale(scale) == weight


# --- agreement with HF transformers itself -----------------------------------------------------

LAYER_TYPES = [
    ("sliding_attention", 0),
    ("compressed_sparse_attention", 4),
    ("heavily_compressed_attention", 128),
    ("compressed_sparse_attention", 4),
]
N_EXPERTS = 2


def _native_names() -> list[str]:
    """Every tensor of a tiny native DeepSeek-V4 checkpoint (reference §6), FP8/MXFP4 scales too."""
    names = [
        "embed.weight",
        "head.weight",
        "norm.weight",
        "hc_head_fn",
        "hc_head_base",
        "hc_head_scale",
    ]
    for i, (_, ratio) in enumerate(LAYER_TYPES):
        p = f"layers.{i}."
        names += [p + n for n in ("attn_norm.weight", "ffn_norm.weight")]
        names += [p + f"hc_{s}_{t}" for s in ("attn", "ffn") for t in ("fn", "base", "scale")]
        names += [
            p + f"attn.{m}.{leaf}"
            for m in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
            for leaf in ("weight", "scale")
        ]
        names += [p + "attn.q_norm.weight", p + "attn.kv_norm.weight", p + "attn.attn_sink"]
        if ratio:
            names += [
                p + f"attn.compressor.{n}"
                for n in ("wkv.weight", "wgate.weight", "ape", "norm.weight")
            ]
        if ratio == 4:
            names += [
                p + f"attn.indexer.{n}"
                for n in ("wq_b.weight", "wq_b.scale", "weights_proj.weight")
            ]
            names += [
                p + f"attn.indexer.compressor.{n}"
                for n in ("wkv.weight", "wgate.weight", "ape", "norm.weight")
            ]
        names.append(p + ("ffn.gate.tid2eid" if i == 0 else "ffn.gate.bias"))
        names.append(p + "ffn.gate.weight")
        names += [
            p + f"ffn.shared_experts.{w}.{leaf}"
            for w in ("w1", "w2", "w3")
            for leaf in ("weight", "scale")
        ]
        names += [
            p + f"ffn.experts.{e}.{w}.{leaf}"
            for e in range(N_EXPERTS)
            for w in ("w1", "w2", "w3")
            for leaf in ("weight", "scale")
        ]
    return names


def _hf_oracle():
    """A tiny quantized HF DeepseekV4ForCausalLM on the meta device and its checkpoint renamer."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("this transformers has no DeepSeek-V4")
    import torch

    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
        from transformers.quantizers.auto import AutoHfQuantizer
    except ImportError as exc:  # these are transformers internals; skip rather than break
        pytest.skip(f"transformers loading internals moved: {exc}")
    cfg = transformers.DeepseekV4Config(
        vocab_size=64,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=32,
        n_routed_experts=N_EXPERTS,
        num_experts_per_tok=1,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=2,
        index_head_dim=32,
        index_topk=4,
        hc_mult=2,
        layer_types=[t for t, _ in LAYER_TYPES],
        mlp_layer_types=["hash_moe"] + ["moe"] * (len(LAYER_TYPES) - 1),
        partial_rotary_factor=0.25,
        sliding_window=8,
    )
    qcfg = transformers.FineGrainedFP8Config(
        weight_block_size=[32, 32], scale_fmt="ue8m0", expert_dtype="fp4"
    )
    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(cfg)
    quantizer = AutoHfQuantizer.from_config(qcfg, pre_quantized=True)
    quantizer.preprocess_model(model, config=cfg)
    state = model.state_dict()
    conversions = get_model_conversion_mapping(model, hf_quantizer=quantizer)
    renames = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]

    def hf_rename(name: str) -> str:
        return rename_source_key(name, renames, converters, "model", state)[0]

    return set(state), hf_rename


def test_mapping_agrees_with_hf_transformers() -> None:
    hf_keys, hf_rename = _hf_oracle()
    native = _native_names()
    mapped = {n: native_to_hf(n) for n in native}
    for n, ours in mapped.items():
        assert ours == hf_rename(n), n
    # Every parameter/buffer of the HF model is produced, and nothing else.
    assert set(mapped.values()) == hf_keys
    # And back: one-to-one names invert, fused expert names expand to their natives.
    for n, ours in mapped.items():
        if expert_slot(n) is None:
            assert hf_to_native(ours) == n
        else:
            slot = expert_slot(n)
            assert slot is not None and n in hf_expert_to_native(ours, slot.expert)
