"""The fast path's weight layouts on the CPU: `--linear-weights fp8` (the swapped DeepSeek-V4
projections hold e4m3 weights, the model still decodes close to the bf16 one, a dense model
refuses the option) and fused projections (one GEMM for q_a + K = V and for the shared expert's
gate + up: the same logits, the same names, and later weight loads reach the fused GEMM; one
fp32 GEMM for the compressor, indexer and head-weight projections of the attention input)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.config import EngineConfig
from kvrelay.engine.runner import ModelRunner
from kvrelay.kernels.triton_fp8_linear import fp8_linear_reference
from kvrelay.models.deepseek_v4 import preset
from kvrelay.models.deepseek_v4.fp8_linears import Fp8Linear, use_fp8_linears
from kvrelay.models.deepseek_v4.fused_projections import fuse_projections, project_wide
from kvrelay.models.deepseek_v4.model import DeepseekV4ForCausalLM
from kvrelay.quant.fp8_block import dequantize_fp8_block, quantize_fp8_block, ue8m0_to_float
from kvrelay.weights.loader import resolve

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only contend


def _random_tiny():
    """dsv4-tiny (QAT off) with random weights and a few token ids."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("dsv4-tiny"), qat_simulation=False)
    model = DeepseekV4ForCausalLM(cfg, torch.float32)
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    return cfg, model, torch.randint(0, cfg.vocab_size, (24,))


def test_reference_is_dequantize_then_matmul():
    torch.manual_seed(0)
    w = torch.randn(300, 200)
    q, s = quantize_fp8_block(w)
    x = torch.randn(5, 200)
    expect = x @ dequantize_fp8_block(q, s, dtype=torch.float32).T
    torch.testing.assert_close(fp8_linear_reference(x, q, ue8m0_to_float(s)), expect)


def test_swapped_model_stays_close():
    cfg, model, ids = _random_tiny()
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


def test_fused_equals_separate_and_follows_loads():
    cfg, model, ids = _random_tiny()
    before = model(ids)
    names = sorted(model.state_dict())
    compressed = sum(layer.self_attn.compressor is not None for layer in model.model.layers)
    assert compressed > 0
    assert fuse_projections(model) == 2 * cfg.num_hidden_layers + compressed
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


def test_dsv4_fast_path_refuses_tensor_parallelism():
    """TP runs the torch path on the CPU; the Triton kernels and CUDA graphs are single-rank."""

    cfg = EngineConfig(
        model="dsv4-tiny", load_format="dummy", device="cpu", tensor_parallel_size=2,
        attention_backend="triton",
    )  # fmt: skip
    with pytest.raises(ValueError, match="Triton kernels and CUDA graphs are single-rank"):
        ModelRunner(cfg, resolve("dsv4-tiny", "dummy"))


def test_wide_projections_in_one_gemm_equal_separate_ones_and_follow_loads():
    """The fused fp32 GEMM of a CSA layer's five wide projections gives each projection's
    output (fp32 dot products over the same terms: equal to rounding) and is made again after
    an in-place load into one of its weights."""
    cfg, model, _ = _random_tiny()
    model = model.to(torch.bfloat16)
    fuse_projections(model)
    attn = next(
        layer.self_attn for layer in model.model.layers if layer.self_attn.indexer is not None
    )
    lins = attn.wide_linears()
    assert len(lins) == 5
    x = torch.randn(7, cfg.hidden_size).to(torch.bfloat16)
    for _ in range(2):
        separate = project_wide(x, None, *lins)
        fused = project_wide(x, attn.fused_wide, *lins)
        for a, b in zip(fused, separate, strict=True):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # a load into the indexer's gate weight, in place
            w = lins[3].weight
            w.copy_(torch.randn_like(w))
