"""Fused projections (one GEMM for q_a + K = V, one for the shared expert's gate + up) give the
same logits as separate ones, keep the weights' names and views, and see later weight loads."""

from __future__ import annotations

import dataclasses

import torch

from kvrelay.models.deepseek_v4 import preset
from kvrelay.models.deepseek_v4.fused_projections import fuse_projections
from kvrelay.models.deepseek_v4.model import DeepseekV4ForCausalLM


def test_fused_equals_separate_and_follows_loads():
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("dsv4-tiny"), qat_simulation=False)
    model = DeepseekV4ForCausalLM(cfg, torch.float32)
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    ids = torch.randint(0, cfg.vocab_size, (20,))
    before = model(ids)
    names = sorted(model.state_dict())
    assert fuse_projections(model) == 2 * cfg.num_hidden_layers
    assert sorted(model.state_dict()) == names
    torch.testing.assert_close(model(ids), before, atol=1e-5, rtol=1e-5)

    # a load into a fused weight (in place, as loaders do) reaches the fused GEMM
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        w = model.state_dict()["model.layers.1.self_attn.kv_proj.weight"]
        w.add_(torch.randn_like(w) * 0.05)  # (a scale alone would vanish in the norm)
    assert torch.equal(attn.fused_in[-attn.kv_proj.weight.shape[0] :], attn.kv_proj.weight)
    fused_out = model(ids)
    attn.fused_in = None  # the separate projections read the same (changed) weights
    torch.testing.assert_close(model(ids), fused_out, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fused_out, before, atol=1e-3)
