"""DeepSeek-V4 checkpoints written by transformers' own save_pretrained load through resolve() +
build_model(), and the engine's greedy tokens equal transformers' (its full forward, float32).

transformers 5.24 saves its DeepSeek-V4 under the original per-layer names below `model.`
(`attn.wq_a`, `ffn.experts.E.w1`, `hc_attn_fn`, ...) with `model.embed_tokens.weight` and
`head.weight`, and its own config.json (layer_types, mlp_layer_types, compress_rates, ...).
index_topk covers every compressed entry of these lengths, where transformers' forward is a valid
oracle (tests/models/test_deepseek_v4_hf_parity.py says why not otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dsv4_hf import hf_greedy, hf_logits, load_hf, save_with_transformers
from safetensors import safe_open

from kvrelay.config import CacheConfig, EngineConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.models.deepseek_v4 import preset
from kvrelay.weights.dsv4_checkpoint import CheckpointError, Dsv4Checkpoint
from kvrelay.weights.loader import build_model, resolve

CFG = preset("dsv4-tiny").with_(qat_simulation=False, index_topk=64)
T = 200  # 50 ratio-4 entries (<= index_topk), 12 ratio-16 entries, the 16-token window 12 times over
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _stored_names(path: Path) -> set[str]:
    names: set[str] = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as g:
            names |= set(g.keys())
    return names


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """fp32 in one file; bf16 in shards with an index (as the tiny agent is saved)."""
    out = {}
    for name, dtype, shard in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, "200KB")):
        path = tmp_path_factory.mktemp(f"tf_save_{name}")
        save_with_transformers(CFG, path, seed=5, dtype=dtype, max_shard_size=shard)
        out[name] = (path, load_hf(path))  # transformers reads its own save back, in float32
    return out


def test_transformers_writes_the_layout_we_read(saved) -> None:
    """The names this loader's mapping assumes are what transformers writes (guards an upgrade)."""
    path, _ = saved["fp32"]
    names = _stored_names(path)
    for n in (
        "head.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.hc_head.hc_fn",
        "model.layers.1.attn.wq_a.weight",
        "model.layers.1.attn.norm.weight",  # the KV norm
        "model.layers.1.attn.compressor.norm.weight",
        "model.layers.1.attn.indexer.compressor.ape",
        "model.layers.0.ffn.gate.tid2eid",
        "model.layers.2.ffn.experts.7.w3.weight",
        "model.layers.2.hc_ffn_fn",
    ):
        assert n in names, n
    assert not any(".self_attn." in n or ".mlp." in n or n.startswith("model.mtp.") for n in names)
    assert len(_stored_names(saved["bf16"][0]) - names) == 0
    assert (saved["bf16"][0] / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_config_and_format_are_read(saved, which: str) -> None:
    path, _ = saved[which]
    src = resolve(str(path))
    # transformers' config.json gives the same config (the borrowed tokenizer brings BOS/EOS);
    # no QAT simulation, like the transformers forward these weights come from.
    assert src.config.with_(bos_token_id=0, eos_token_id=1) == CFG
    raw = json.loads((path / "config.json").read_text())
    assert "qat_simulation" not in raw and "compress_ratios" not in raw
    with Dsv4Checkpoint(str(path)) as ckpt:
        f = ckpt.format
        assert (f.naming, f.linears, f.experts, f.mtp_experts) == (
            "transformers",
            "none",
            "none",
            None,
        )


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_every_parameter_equals_transformers(saved, which: str) -> None:
    path, hf = saved[which]
    own = build_model(resolve(str(path)), torch.float32, CPU).state_dict()
    ref = hf.state_dict()
    assert set(own) - set(ref) == {k for k in own if k.startswith("model.mtp.")}  # HF has no MTP
    for name, t in ref.items():
        assert torch.equal(own[name], t), name
    # Distinct values, so a swap (the KV norm for the compressor's, w1 for w3) cannot pass.
    assert not torch.equal(
        ref["model.layers.1.self_attn.kv_norm.weight"],
        ref["model.layers.1.self_attn.compressor.kv_norm.weight"],
    )


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_logits_match_transformers(saved, which: str) -> None:
    path, hf = saved[which]
    model = build_model(resolve(str(path)), torch.float32, CPU)
    ids = _ids(T, seed=1)
    got, want = model(ids), hf_logits(hf, ids)
    scale = want.abs().max().item()
    assert scale > 1.0
    assert (got - want).abs().max().item() <= 1e-4 * scale


def test_engine_greedy_equals_transformers(saved) -> None:
    """The serving path (paged pools, chunked prefill, decode steps) against transformers."""
    path, hf = saved["bf16"]
    engine = Engine(
        EngineConfig(
            model=str(path), device="cpu", dtype="float32", cache=CacheConfig(max_total_tokens=2048)
        )
    )
    prompts = [_ids(70, seed=2).tolist(), _ids(33, seed=3).tolist()]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = generate(engine, prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        got = [t for o in out for t in o.token_ids]
        assert got == hf_greedy(hf, prompt, 10)


def _copy_without(src: Path, dst: Path, drop: str, rename: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = {}
    for f in src.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as g:
            for n in g.keys():
                if drop not in n:
                    tensors[(rename or {}).get(n, n)] = g.get_tensor(n)
    save_file(tensors, str(dst / "model.safetensors"))


def test_incomplete_or_unknown_tensors_fail_naming_them(saved, tmp_path) -> None:
    path, _ = saved["fp32"]
    _copy_without(path, tmp_path / "no_experts", ".ffn.experts.")
    with pytest.raises(CheckpointError, match=r"model\.layers\.N\.ffn\.experts\.N\.w1\.weight"):
        resolve(str(tmp_path / "no_experts"))
    unknown = {"model.layers.3.attn.wq_a.weight": "model.layers.3.attn.wq_z.weight"}
    _copy_without(path, tmp_path / "unknown", "@", unknown)
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.attn\.wq_z\.weight"):
        build_model(resolve(str(tmp_path / "unknown")), torch.float32, CPU)
    _copy_without(path, tmp_path / "lost_norm", "layers.2.attn.norm.")
    with pytest.raises(CheckpointError, match=r"missing.*layers\.2\.self_attn\.kv_norm"):
        build_model(resolve(str(tmp_path / "lost_norm")), torch.float32, CPU)


def test_config_json_may_ask_for_the_qat_simulation(saved, tmp_path) -> None:
    path, _ = saved["fp32"]
    _copy_without(path, tmp_path / "qat", "@")
    raw = json.loads((tmp_path / "qat" / "config.json").read_text())
    (tmp_path / "qat" / "config.json").write_text(json.dumps(raw | {"qat_simulation": True}))
    assert resolve(str(tmp_path / "qat")).config.qat_simulation
    assert not resolve(str(path)).config.qat_simulation
