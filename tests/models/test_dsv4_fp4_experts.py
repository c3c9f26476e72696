"""Packed NVFP4 and MXFP4 experts compute what dense experts holding their dequantized weights
compute."""

from __future__ import annotations

import pytest
import torch

from kvrelay.models.deepseek_v4 import DeepseekV4ForCausalLM, init_dummy_weights, preset
from kvrelay.models.deepseek_v4.experts import Fp4Experts, Mxfp4Experts, QuantizedExperts
from kvrelay.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from kvrelay.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_model_equals_dense_model_on_dequantized_weights(fmt: str) -> None:
    cfg = preset("dsv4-tiny").with_(qat_simulation=False)
    fp4 = DeepseekV4ForCausalLM(cfg.with_(expert_format=fmt))
    init_dummy_weights(fp4, seed=3)
    dense = DeepseekV4ForCausalLM(cfg)
    sd = {k: v for k, v in fp4.state_dict().items() if "experts." not in k or "shared" in k}
    for name, m in fp4.named_modules():
        if isinstance(m, QuantizedExperts):
            assert m.fp4_format == fmt
            sd[f"{name}.gate_up_proj"], sd[f"{name}.down_proj"] = m.dense()
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


def test_mxfp4_experts_hold_the_checkpoint_bytes_and_dequantize_like_the_reference() -> None:
    cfg = preset("dsv4-tiny").with_(expert_format="mxfp4")
    mx, g = Mxfp4Experts(cfg), torch.Generator().manual_seed(2)
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    gate_up = quantize_mxfp4(torch.randn(2 * i, h, generator=g) * 3, "uint8", torch.uint8)
    down = quantize_mxfp4(torch.randn(h, i, generator=g) / 8, "uint8", torch.uint8)
    e = 3
    mx.gate_up_packed[e], mx.gate_up_scale[e] = gate_up
    mx.down_packed[e], mx.down_scale[e] = down
    got_gate_up, got_down = mx.expert_weights(e)
    assert torch.equal(got_gate_up, dequantize_mxfp4(*gate_up, torch.float32))
    assert torch.equal(got_down, dequantize_mxfp4(*down, torch.float32))
    assert got_gate_up.abs().max() > 0 and torch.isfinite(got_gate_up).all()
