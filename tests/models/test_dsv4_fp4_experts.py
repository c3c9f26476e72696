"""Packed NVFP4 experts compute what dense experts holding their dequantized weights compute."""

from __future__ import annotations

import torch

from kvrelay.models.deepseek_v4 import DeepseekV4ForCausalLM, init_dummy_weights, preset
from kvrelay.models.deepseek_v4.experts import Fp4Experts
from kvrelay.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4


def test_fp4_model_equals_dense_model_on_dequantized_weights() -> None:
    cfg = preset("dsv4-tiny").with_(qat_simulation=False)
    fp4 = DeepseekV4ForCausalLM(cfg.with_(expert_format="nvfp4"))
    init_dummy_weights(fp4, seed=3)
    dense = DeepseekV4ForCausalLM(cfg)
    sd = {k: v for k, v in fp4.state_dict().items() if "experts." not in k or "shared" in k}
    for name, m in fp4.named_modules():
        if isinstance(m, Fp4Experts):
            gate_up, down = zip(
                *(m.expert_weights(e) for e in range(cfg.n_routed_experts)), strict=True
            )
            sd[f"{name}.gate_up_proj"] = torch.stack(gate_up)
            sd[f"{name}.down_proj"] = torch.stack(down)
    dense.load_state_dict(sd, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    want, got = dense(ids), fp4(ids)
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    # the dummy weights are fan-in scaled like the dense ones: activations stay O(1)
    w = sd[next(k for k in sd if k.endswith("experts.gate_up_proj"))]
    assert 0.5 < w.std().item() * cfg.hidden_size**0.5 < 2.0


def test_fp4_expert_layout_gate_rows_then_up_rows_each_with_its_global_scale() -> None:
    cfg = preset("dsv4-tiny").with_(expert_format="nvfp4")
    fp4, g = Fp4Experts(cfg), torch.Generator().manual_seed(1)
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    gate, up = (
        quantize_nvfp4(torch.randn(i, h, generator=g)),
        quantize_nvfp4(torch.randn(i, h, generator=g) * 8),
    )
    down = quantize_nvfp4(torch.randn(h, i, generator=g) / 8)
    e = 5
    fp4.gate_up_packed[e] = torch.cat((gate.weight, up.weight))
    fp4.gate_up_scale[e] = torch.cat((gate.weight_scale, up.weight_scale))
    fp4.gate_up_scale_2[e] = torch.stack((gate.weight_scale_2, up.weight_scale_2))
    fp4.down_packed[e], fp4.down_scale[e] = down.weight, down.weight_scale
    fp4.down_scale_2[e] = down.weight_scale_2
    gate_up, w_down = fp4.expert_weights(e)
    want = torch.cat([dequantize_nvfp4(*q[:3], torch.float32) for q in (gate, up)])
    assert torch.equal(gate_up, want)
    assert torch.equal(w_down, dequantize_nvfp4(*down[:3], torch.float32))
