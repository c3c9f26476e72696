"""Tensor-parallel split rules: shards put back together give the full tensor, and the split
layers computed rank by rank (partial sums added, as an all-reduce would) equal the whole."""

from __future__ import annotations

import pytest
import torch

from kvrelay.models.deepseek_v4 import DeepseekV4ForCausalLM, init_dummy_weights, preset
from kvrelay.models.deepseek_v4.moe import clamped_swiglu
from kvrelay.quant import dequantize_mxfp4, quantize_mxfp4
from kvrelay.weights.dsv4_shard import shard, shard_rule, unshard

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend

CFG = preset("dsv4-tiny").with_(hidden_size=256, q_lora_rank=128, moe_intermediate_size=64)


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    model = DeepseekV4ForCausalLM(CFG)
    init_dummy_weights(model, seed=1)
    return model.state_dict()


@pytest.mark.parametrize("world", [1, 2])
def test_shards_concatenate_back(state, world: int) -> None:
    for name, t in state.items():
        parts = [shard(name, t, r, world) for r in range(world)]
        assert torch.equal(unshard(name, parts), t), name
        kind, dim = shard_rule(name)
        if kind != "replicate" and world > 1:
            assert all(p.shape[dim] == t.shape[dim] // world for p in parts), name


def test_rules_of_each_kind(state) -> None:
    p = "model.layers.1."
    assert shard_rule(p + "self_attn.q_b_proj.weight") == ("column", 0)
    assert shard_rule(p + "self_attn.o_b_proj.weight") == ("row", 1)
    assert shard_rule(p + "self_attn.kv_proj.weight") == ("replicate", 0)  # one shared KV head
    assert shard_rule(p + "self_attn.compressor.kv_proj.weight") == ("replicate", 0)
    assert shard_rule(p + "self_attn.compressor.indexer.q_b_proj.weight") == ("column", 0)
    assert shard_rule(p + "mlp.experts.gate_up_proj") == ("gate_up", 1)
    assert shard_rule("model.mtp.0.mlp.experts.down_proj") == ("row", 2)
    assert shard_rule("model.mtp.0.e_proj.weight") == ("replicate", 0)
    assert shard_rule("lm_head.weight") == ("column", 0)
    # Rank 1's gate_up slice is [gate rows of rank 1; up rows of rank 1], not rows I..2I.
    gu = state[p + "mlp.experts.gate_up_proj"]
    i = CFG.moe_intermediate_size
    part = shard(p + "mlp.experts.gate_up_proj", gu, 1, 2)
    assert torch.equal(part, torch.cat([gu[:, i // 2 : i], gu[:, i + i // 2 :]], 1))
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        shard(p + "self_attn.sinks", state[p + "self_attn.sinks"], 0, 3)  # 4 heads


def test_split_moe_sums_to_the_full_output(state) -> None:
    p, world, limit = "model.layers.2.mlp.", 2, CFG.swiglu_limit
    x = torch.randn(5, CFG.hidden_size, generator=torch.Generator().manual_seed(0))

    def expert(gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ gate_up.T).chunk(2, dim=-1)
        return clamped_swiglu(gate, up, limit) @ down.T

    gu, dn = state[p + "experts.gate_up_proj"][4], state[p + "experts.down_proj"][4]
    full = expert(gu, dn)
    parts = sum(
        expert(
            shard(p + "experts.gate_up_proj", gu[None], r, world)[0],
            shard(p + "experts.down_proj", dn[None], r, world)[0],
        )
        for r in range(world)
    )
    torch.testing.assert_close(parts, full, rtol=1e-5, atol=1e-5)

    names = [p + f"shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    g, u, d = (state[n] for n in names)
    full = clamped_swiglu(x @ g.T, x @ u.T, limit) @ d.T
    parts = sum(
        clamped_swiglu(
            x @ shard(names[0], g, r, world).T, x @ shard(names[1], u, r, world).T, limit
        )
        @ shard(names[2], d, r, world).T
        for r in range(world)
    )
    torch.testing.assert_close(parts, full, rtol=1e-5, atol=1e-5)


def test_packed_fp4_experts_split_like_the_dense_ones(state) -> None:
    # Each rank's K range of down_proj (I/2 = 32 inputs) is one whole MXFP4 scale block.
    for name in ("model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj"):
        packed, scales = quantize_mxfp4(state[name])
        dense = dequantize_mxfp4(packed, scales, torch.float32)
        for r in range(2):
            got = dequantize_mxfp4(
                shard(name, packed, r, 2), shard(name, scales, r, 2), torch.float32
            )
            assert torch.equal(got, shard(name, dense, r, 2)), (name, r)
