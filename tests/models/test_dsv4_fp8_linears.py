"""`--linear-weights fp8` on the CPU (the kernel's torch reference): the swapped DeepSeek-V4
projections hold e4m3 weights whose dequantized values are the bf16 weights rounded to FP8, the
model still decodes close to the bf16 one, and a dense model refuses the option."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.config import EngineConfig
from kvrelay.engine.runner import ModelRunner
from kvrelay.kernels.triton_fp8_linear import fp8_linear_reference
from kvrelay.models.deepseek_v4 import preset
from kvrelay.models.deepseek_v4.fp8_linears import Fp8Linear, use_fp8_linears
from kvrelay.models.deepseek_v4.model import DeepseekV4ForCausalLM
from kvrelay.quant.fp8_block import dequantize_fp8_block, quantize_fp8_block, ue8m0_to_float
from kvrelay.weights.loader import resolve


def test_reference_is_dequantize_then_matmul():
    torch.manual_seed(0)
    w = torch.randn(300, 200)
    q, s = quantize_fp8_block(w)
    x = torch.randn(5, 200)
    expect = x @ dequantize_fp8_block(q, s, dtype=torch.float32).T
    torch.testing.assert_close(fp8_linear_reference(x, q, ue8m0_to_float(s)), expect)


def test_swapped_model_stays_close():
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("dsv4-tiny"), qat_simulation=False)
    model = DeepseekV4ForCausalLM(cfg, torch.float32)
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    ids = torch.randint(0, cfg.vocab_size, (24,))
    before = model(ids)
    n = use_fp8_linears(model)
    assert n == 8 * cfg.num_hidden_layers
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_a_proj, Fp8Linear)
    assert layer.self_attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    after = model(ids)
    rel = (after - before).norm() / before.norm()
    assert 0 < rel < 0.1, rel


def test_dense_model_refuses_fp8_linears():
    cfg = EngineConfig(model="qwen3-tiny", load_format="dummy", device="cpu", linear_weights="fp8")
    with pytest.raises(ValueError, match="linear-weights"):
        ModelRunner(cfg, resolve("qwen3-tiny", "dummy"))
