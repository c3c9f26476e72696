"""DeepSeek-V4 checkpoints in the three layouts load through resolve() + build_model().

The model is dsv4-tiny widened so that the checkpoint formats have real block structure:
hidden 256 and q_lora 128 give FP8 weights several 128x128 blocks, full and partial
(wq_b [384, 128] -> 3x1, wkv [96, 256] -> 1x2 with partial rows); moe_intermediate 64 gives w2
two MXFP4 blocks (32) and four NVFP4 blocks (16) per row. (dsv4-tiny's hidden 64 would make
every FP8 weight one partial block.) QAT simulation stays on, as in the preset.

Expected weights are computed here from the model with the quant functions, following the
dtype table of reference §6/§7 written out by hand (not the writer's rules).
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.models.deepseek_v4 import DeepseekV4ForCausalLM, init_dummy_weights, preset
from kvrelay.models.deepseek_v4.experts import Fp4Experts, Mxfp4Experts, QuantizedExperts
from kvrelay.quant import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
)
from kvrelay.weights.dsv4_checkpoint import CheckpointError, Dsv4Checkpoint
from kvrelay.weights.dsv4_config import is_dsv4_dir
from kvrelay.weights.dsv4_shard import unshard
from kvrelay.weights.dsv4_writer import save_dsv4_checkpoint, save_safetensors
from kvrelay.weights.loader import build_model, resolve

CFG = preset("dsv4-tiny").with_(hidden_size=256, q_lora_rank=128, moe_intermediate_size=64)
LAYOUTS = ("hf", "native", "nvfp4")
SHARDS = {"hf": 2, "native": 1, "nvfp4": 2}
IDS = (torch.arange(48) * 37 + 5) % CFG.vocab_size  # 48 tokens: 12 ratio-4 entries > top-8

# Reference §6: FP8 + 128x128 ue8m0 scale (e_proj/h_proj of the MTP block: inferred).
FP8 = re.compile(
    r".*\.(self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj|compressor\.indexer\.q_b_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)|e_proj|h_proj)\.weight"
)
# Reference §6: stored F32 (mHC, sinks, ape, router bias) or I64 (tid2eid); the rest is BF16.
AS_STORED = re.compile(
    r".*(_hc\.(fn|base|scale)|hc_head\.hc_\w+|\.sinks|position_bias|e_score_correction_bias|tid2eid)"
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops


@pytest.fixture(scope="module")
def original() -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(CFG)
    init_dummy_weights(model, seed=3)
    return model.eval()


@pytest.fixture(scope="module")
def dirs(original, tmp_path_factory) -> dict[str, str]:
    out = {}
    for layout in LAYOUTS:
        path = str(tmp_path_factory.mktemp(layout))
        save_dsv4_checkpoint(original, path, layout, shards=SHARDS[layout])
        out[layout] = path
    return out


def _fp8(w: torch.Tensor) -> torch.Tensor:
    return dequantize_fp8_block(*quantize_fp8_block(w), dtype=torch.float32)


def _mxfp4(w: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp4(*quantize_mxfp4(w), dtype=torch.float32)


def _nvfp4(w: torch.Tensor, per: int) -> torch.Tensor:
    """NVFP4 with one global scale per matrix: stacks [E, per*R, C] hold `per` matrices each."""
    e, rows, cols = w.shape
    q = quantize_nvfp4(w.reshape(e, per, rows // per, cols))
    return dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, torch.float32).reshape(
        w.shape
    )


def expected(name: str, t: torch.Tensor, layout: str) -> torch.Tensor:
    """What the loaded float32 model must hold: quantize -> dequantize of the original."""
    if layout == "hf":
        return t
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        if layout == "nvfp4" and name.startswith("model.layers."):
            return _nvfp4(t, 2 if name.endswith("gate_up_proj") else 1)
        return _mxfp4(t)
    if FP8.fullmatch(name):
        return _fp8(t)
    if AS_STORED.fullmatch(name):
        return t
    return t.bfloat16().float()


def dense_state(model: DeepseekV4ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's state dict with packed experts dequantized under the dense names."""
    out = dict(model.state_dict())
    for path, module in model.named_modules():
        if isinstance(module, QuantizedExperts):
            for buf in module.state_dict():
                del out[f"{path}.{buf}"]
            out[f"{path}.gate_up_proj"], out[f"{path}.down_proj"] = module.dense()
    return out


@pytest.fixture(scope="module")
def loaded(dirs) -> dict[str, DeepseekV4ForCausalLM]:
    return {
        layout: build_model(resolve(path), torch.float32, torch.device("cpu"))
        for layout, path in dirs.items()
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resolve_reads_the_config(dirs, layout: str) -> None:
    src = resolve(dirs[layout])
    assert src.kind == "hf" and src.path == dirs[layout]
    # The borrowed tokenizer brings BOS/EOS; nothing else differs, the vocab is not widened;
    # FP4 experts stay packed in memory: native MXFP4 throughout; NVIDIA's layout NVFP4 in the
    # layers and MXFP4 in the MTP block.
    packed = {
        "hf": {},
        "native": {"expert_format": "mxfp4", "mtp_expert_format": "mxfp4"},
        "nvfp4": {"expert_format": "nvfp4", "mtp_expert_format": "mxfp4"},
    }[layout]
    assert src.config.with_(bos_token_id=0, eos_token_id=1) == CFG.with_(**packed)
    assert src.config.vocab_size == CFG.vocab_size
    assert is_dsv4_dir(dirs[layout])


def test_written_layouts_match_the_reference(dirs) -> None:
    def header(path: Path) -> dict:
        raw = path.read_bytes()
        return json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])

    def all_headers(layout: str) -> dict:
        out: dict = {}
        for f in Path(dirs[layout]).glob("*.safetensors"):
            out |= header(f)
        return out

    # (b) native: config only in inference/config.json, native keys.
    assert not os.path.exists(os.path.join(dirs["native"], "config.json"))
    with open(os.path.join(dirs["native"], "inference", "config.json")) as f:
        assert {"dim", "n_layers", "compress_ratios", "moe_inter_dim"} <= set(json.load(f))
    h = all_headers("native")
    assert h["layers.2.attn.wq_b.weight"]["dtype"] == "F8_E4M3"
    assert h["layers.2.attn.wq_b.scale"]["dtype"] == "F8_E8M0"
    assert h["layers.2.attn.wq_b.scale"]["shape"] == [3, 1]
    assert h["layers.2.attn.wkv.scale"]["shape"] == [1, 2]
    w1 = h["layers.2.ffn.experts.7.w1.weight"]
    assert (w1["dtype"], w1["shape"]) == ("I8", [64, 128])
    w2_scale = h["layers.2.ffn.experts.7.w2.scale"]
    assert (w2_scale["dtype"], w2_scale["shape"]) == ("F8_E8M0", [256, 2])
    assert h["embed.weight"]["dtype"] == "BF16" and h["layers.1.hc_attn_fn"]["dtype"] == "F32"
    assert h["layers.0.ffn.gate.tid2eid"]["dtype"] == "I64"
    # (c) NVFP4: U8 + F8_E4M3 per 16 + F32 scalars on layer experts; MTP experts stay MXFP4.
    h = all_headers("nvfp4")
    assert h["layers.3.ffn.experts.0.w2.weight"]["dtype"] == "U8"
    scale = h["layers.3.ffn.experts.0.w2.weight_scale"]
    assert (scale["dtype"], scale["shape"]) == ("F8_E4M3", [256, 4])
    for leaf in ("weight_scale_2", "input_scale"):
        meta = h[f"layers.3.ffn.experts.0.w1.{leaf}"]
        assert (meta["dtype"], meta["shape"]) == ("F32", [])
    assert h["mtp.0.ffn.experts.0.w1.weight"]["dtype"] == "I8"
    assert "mtp.0.ffn.experts.0.w1.weight_scale_2" not in h
    assert h["layers.3.attn.wo_a.weight"]["dtype"] == "F8_E4M3"
    with open(os.path.join(dirs["nvfp4"], "config.json")) as f:
        assert json.load(f)["quantization_config"]["moe_quant_algo"] == "NVFP4"
    assert os.path.exists(os.path.join(dirs["nvfp4"], "model.safetensors.index.json"))


def test_detected_formats(dirs) -> None:
    got = {}
    for layout, path in dirs.items():
        with Dsv4Checkpoint(path) as ckpt:
            f = ckpt.format
            got[layout] = (f.naming, f.linears, f.experts, f.mtp_experts)
    assert got == {
        "hf": ("hf", "none", "none", "none"),
        "native": ("native", "fp8_block", "mxfp4", "mxfp4"),
        "nvfp4": ("native", "fp8_block", "nvfp4", "mxfp4"),
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_parameter_equals_the_dequantized_reference(original, loaded, layout) -> None:
    own = dense_state(loaded[layout])
    ref = original.state_dict()
    assert set(own) == set(ref)
    for name, t in ref.items():
        assert torch.equal(own[name], expected(name, t, layout)), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_equal_the_reference_model(original, loaded, layout) -> None:
    ref = DeepseekV4ForCausalLM(CFG).eval()
    ref.load_hf_state_dict({n: expected(n, t, layout) for n, t in original.state_dict().items()})
    got = loaded[layout](IDS)
    assert torch.equal(got, ref(IDS))
    if layout == "hf":
        assert torch.equal(got, original(IDS))
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("layout", ["native", "nvfp4"])
def test_packed_experts(loaded, dirs, layout) -> None:
    e, i, h = CFG.n_routed_experts, CFG.moe_intermediate_size, CFG.hidden_size
    model = loaded[layout]
    with Dsv4Checkpoint(dirs[layout]) as ckpt:
        for block, module in ((3, model.model.layers[3]), ("mtp.0", model.model.mtp[0])):
            p = ckpt.packed_experts(block)
            fmt = "nvfp4" if layout == "nvfp4" and block == 3 else "mxfp4"
            sblock = 16 if fmt == "nvfp4" else 32
            assert p.fmt == fmt
            assert p.gate_up.dtype == torch.uint8 and p.gate_up.shape == (e, 2 * i, h // 2)
            assert p.gate_up_scale.shape == (e, 2 * i, h // sblock)
            assert p.down.shape == (e, h, i // 2) and p.down_scale.shape == (e, h, i // sblock)
            if fmt == "nvfp4":
                assert p.gate_up_scale.dtype == torch.float8_e4m3fn
                assert p.gate_up_scale_2.shape == (e, 2) and p.down_scale_2.shape == (e,)
                assert bool((p.gate_up_input_scale == 1.0).all())
            else:
                assert p.gate_up_scale.dtype == torch.float8_e8m0fnu
            gate_up, down = p.dequantize(torch.float32)
            experts = module.mlp.experts
            # the model holds the checkpoint's bytes, not a dequantized copy
            assert isinstance(experts, Fp4Experts if fmt == "nvfp4" else Mxfp4Experts)
            assert torch.equal(experts.gate_up_packed, p.gate_up)
            assert torch.equal(experts.down_packed, p.down)
            for mine, theirs in ((experts.gate_up_scale, p.gate_up_scale),
                                 (experts.down_scale, p.down_scale)):  # fmt: skip
                assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
            if fmt == "nvfp4":
                assert torch.equal(experts.gate_up_scale_2, p.gate_up_scale_2)
            dense_gate_up, dense_down = experts.dense()
            assert torch.equal(gate_up, dense_gate_up) and torch.equal(down, dense_down)


def test_stream_feeds_load_hf_state_dict_and_tp_shards(loaded, dirs) -> None:
    with Dsv4Checkpoint(dirs["nvfp4"]) as ckpt:
        full = dict(ckpt.tensors(torch.float32))
        model = DeepseekV4ForCausalLM(CFG)
        model.load_hf_state_dict(full)
        for name, t in dense_state(loaded["nvfp4"]).items():
            assert torch.equal(model.state_dict()[name], t), name
        ranks = [dict(ckpt.tensors(torch.float32, tp=(r, 2))) for r in range(2)]
    for name, t in full.items():
        assert torch.equal(unshard(name, [ranks[0][name], ranks[1][name]]), t), name
    heads_half = CFG.num_attention_heads * CFG.head_dim // 2
    assert ranks[1]["model.layers.1.self_attn.q_b_proj.weight"].shape == (
        heads_half,
        CFG.q_lora_rank,
    )


def _rewrite(src: str, dst: Path, drop: str) -> None:
    """A copy of checkpoint `src` without the tensors whose names match `drop`."""
    with Dsv4Checkpoint(src) as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.index if not re.fullmatch(drop, n)}
    for sub in ("config.json", "inference/config.json"):
        if os.path.exists(os.path.join(src, sub)):
            os.makedirs(os.path.dirname(dst / sub), exist_ok=True)
            (dst / sub).write_text(Path(src, sub).read_text())
    save_safetensors(tensors, str(dst))


def test_absent_mtp_block_is_allowed(dirs, original, tmp_path) -> None:
    _rewrite(dirs["hf"], tmp_path, r"model\.mtp\..*")
    model = build_model(resolve(str(tmp_path)), torch.float32, torch.device("cpu"))
    ref = original.state_dict()
    for name, t in model.state_dict().items():
        if not name.startswith("model.mtp."):
            assert torch.equal(t, ref[name]), name


def test_missing_or_unknown_tensors_raise(dirs, tmp_path) -> None:
    _rewrite(dirs["native"], tmp_path / "a", r"layers\.2\.ffn\.experts\.5\.w3\.(weight|scale)")
    # native MXFP4 experts load packed: the packed reader names the lost matrix
    with pytest.raises(
        CheckpointError, match=r"layers.2.ffn.experts: \(expert, part\) \[\(5, 'w3'\)\]"
    ):
        build_model(resolve(str(tmp_path / "a")), torch.float32, torch.device("cpu"))
    _rewrite(dirs["native"], tmp_path / "b", r"layers\.4\.attn_norm\.weight")
    with pytest.raises(CheckpointError, match="missing.*layers.4.input_layernorm"):
        build_model(resolve(str(tmp_path / "b")), torch.float32, torch.device("cpu"))


def test_hf_names_with_fp8_and_mxfp4_tensors(original, tmp_path) -> None:
    """HF-named quantized checkpoint: `.weight_scale_inv` (float32 multipliers here) beside FP8
    weights, fused experts as packed MXFP4 with `gate_up_proj_scale_inv` / `down_proj_scale_inv`."""
    tensors = {}
    for name, t in original.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name], tensors[name + "_scale_inv"] = quantize_mxfp4(t)
        elif FP8.fullmatch(name):
            q, scale = quantize_fp8_block(t, scale_format="float32")
            tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = q, scale
        else:
            tensors[name] = t
    save_safetensors(tensors, str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    model = build_model(resolve(str(tmp_path)), torch.float32, torch.device("cpu"))
    assert isinstance(model.model.layers[2].mlp.experts, Mxfp4Experts)  # held packed
    own = dense_state(model)
    for name, t in original.state_dict().items():
        fused = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        want = _mxfp4(t) if fused else _fp8(t) if FP8.fullmatch(name) else t
        assert torch.equal(own[name], want), name
    with Dsv4Checkpoint(str(tmp_path)) as ckpt:
        assert (ckpt.format.naming, ckpt.format.linears, ckpt.format.experts) == (
            "hf",
            "fp8_block",
            "mxfp4",
        )
        gate_up, down = ckpt.packed_experts(2).dequantize(torch.float32)
    assert torch.equal(gate_up, own["model.layers.2.mlp.experts.gate_up_proj"])
    assert torch.equal(down, own["model.layers.2.mlp.experts.down_proj"])


def test_dense_directories_are_not_dsv4(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert not is_dsv4_dir(str(tmp_path))


def test_engine_on_the_nvfp4_checkpoint_matches_a_greedy_forward_loop(dirs, loaded) -> None:
    cfg = EngineConfig(
        model=dirs["nvfp4"],
        device="cpu",
        dtype="float32",
        cache=CacheConfig(max_total_tokens=2048),
    )
    engine = Engine(cfg)
    prompt = IDS[:21].tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = generate(engine, [prompt], params)[0]
    got = [t for out in outs for t in out.token_ids]
    model, ids = loaded["nvfp4"], list(prompt)
    for _ in range(6):
        ids.append(int(model(torch.tensor(ids))[-1].argmax()))
    assert got == ids[len(prompt) :]


@pytest.mark.parametrize("layout", ["native", "nvfp4"])
def test_fp4_experts_load_packed_without_dequantizing(dirs, monkeypatch, layout) -> None:
    read = []
    real = Dsv4Checkpoint.read_dequantized
    monkeypatch.setattr(
        Dsv4Checkpoint, "read_dequantized", lambda self, n, *a: read.append(n) or real(self, n, *a)
    )
    model = build_model(resolve(dirs[layout]), torch.float32, torch.device("cpu"))
    assert not [n for n in read if ".ffn.experts." in n]  # layers and the MTP block alike
    layers = [layer.mlp.experts for layer in model.model.layers]
    assert all(isinstance(x, Fp4Experts if layout == "nvfp4" else Mxfp4Experts) for x in layers)
    assert isinstance(model.model.mtp[0].mlp.experts, Mxfp4Experts)
    # 4.5 bits a weight (e2m1 + an e4m3 scale per 16) against 32 for the float32 model.
    packed = sum(b.numel() * b.element_size() for x in layers for b in x.buffers())
    e, i, h = CFG.n_routed_experts, CFG.moe_intermediate_size, CFG.hidden_size
    assert packed < 3 * e * i * h * 4.6 / 8 * len(layers)
