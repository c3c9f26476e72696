"""The dummy presets: every one builds (on the meta device), and qwen3-tiny runs deterministically."""

from __future__ import annotations

import functools

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams
from kvrelay.models.llama.model import LlamaForCausalLM
from kvrelay.models.presets import PRESETS
from kvrelay.models.registry import model_class

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend


@functools.cache
def _meta_model(name: str) -> LlamaForCausalLM:
    cfg = PRESETS[name]
    with torch.device("meta"):
        return model_class(cfg.architecture)(cfg)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_with_the_configured_shapes(name: str) -> None:
    cfg = PRESETS[name]
    model = _meta_model(name)
    p = model.hf_state_dict()  # HF names: the fused q/k/v and gate/up split back
    h, d = cfg.hidden_size, cfg.head_dim
    assert p["model.embed_tokens.weight"].shape == (cfg.vocab_size, h)
    assert ("lm_head.weight" in p) is not cfg.tie_word_embeddings
    assert sum(k.endswith("input_layernorm.weight") for k in p) == cfg.num_layers
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        assert p[pre + "self_attn.q_proj.weight"].shape == (cfg.num_heads * d, h)
        assert p[pre + "self_attn.k_proj.weight"].shape == (cfg.num_kv_heads * d, h)
        assert p[pre + "self_attn.v_proj.weight"].shape == (cfg.num_kv_heads * d, h)
        assert p[pre + "self_attn.o_proj.weight"].shape == (h, cfg.num_heads * d)
        assert p[pre + "mlp.gate_proj.weight"].shape == (cfg.intermediate_size, h)
        assert p[pre + "mlp.down_proj.weight"].shape == (h, cfg.intermediate_size)
        assert (pre + "self_attn.q_norm.weight" in p) is cfg.qk_norm
    assert cfg.num_heads % cfg.num_kv_heads == 0


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_params_counts_every_parameter(name: str) -> None:
    model = _meta_model(name)
    assert PRESETS[name].num_params == sum(p.numel() for p in model.parameters())


def test_llama_1b_is_llama_3_2_1b_shaped() -> None:
    cfg = PRESETS["llama-1b"]
    assert cfg.num_params == pytest.approx(1.24e9, rel=0.01)
    assert cfg.num_params == 1_235_814_400  # Llama-3.2-1B, tied embeddings
    model = _meta_model("llama-1b")
    assert all(p.device.type == "meta" for p in model.parameters())
    p = model.hf_state_dict()
    assert p["model.layers.0.self_attn.q_proj.weight"].shape == (2048, 2048)
    assert p["model.layers.0.self_attn.k_proj.weight"].shape == (512, 2048)
    assert p["model.layers.0.mlp.up_proj.weight"].shape == (8192, 2048)
    assert len(model.model.layers) == 16 and not hasattr(model, "lm_head")


def test_llama_1b_rope_matches_hf_llama3() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvrelay.layers.rope import RotaryEmbedding

    cfg = PRESETS["llama-1b"]
    hf_cfg = transformers.LlamaConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={**cfg.rope_scaling, "rope_theta": cfg.rope_theta},
    )
    ref, scaling = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, torch.device("cpu"))
    ours = RotaryEmbedding(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, 4096, torch.float32, "cpu"
    )
    pos = torch.arange(4096).float()[:, None] * ref.float()[None, :]
    want = torch.cat((pos, pos), -1)
    torch.testing.assert_close(ours.cos, want.cos() * scaling, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin, want.sin() * scaling, rtol=0, atol=1e-6)


def _qwen3_tiny(seed: int) -> Engine:
    return Engine(
        EngineConfig(
            model="qwen3-tiny",
            load_format="dummy",
            device="cpu",
            dtype="float32",
            cuda_graphs=False,
            seed=seed,
            cache=CacheConfig(max_total_tokens=256),
        )
    )


def _run(engine: Engine, sampled: bool = True) -> list[list[int]]:
    prompts = [[1, 2, 3, 4, 5], [100, 2000, 30000, 7, 8, 9, 10]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    unseeded = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    params = [greedy, greedy, seeded, seeded, unseeded, unseeded] if sampled else [greedy] * 2
    outs = generate(engine, prompts * (len(params) // 2), params)
    engine.check_idle_integrity()
    return [[t for o in out for t in o.token_ids] for out in outs]


def test_qwen3_tiny_generates_deterministically() -> None:
    a = _run(_qwen3_tiny(seed=0))
    b = _run(_qwen3_tiny(seed=0))
    assert a == b
    vocab = PRESETS["qwen3-tiny"].vocab_size
    assert all(len(t) == 6 and all(0 <= x < vocab for x in t) for t in a)
    # A different engine seed gives different dummy weights, hence different greedy tokens.
    c = _run(_qwen3_tiny(seed=1), sampled=False)
    assert c != a[:2]
