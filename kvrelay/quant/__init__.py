"""Checkpoint quantization formats of DeepSeek-V4-class models, as pure torch functions.

- :mod:`.fp8_block`: FP8 e4m3 weights with ue8m0 scales per 128x128 block; the block-64 FP8
  activation simulation (QAT) of the reference model; ue8m0 byte helpers.
- :mod:`.fp4`: the e2m1 table, nibble packing (low nibble = even element), the block-32 FP4
  activation simulation of the indexer.
- :mod:`.mxfp4`: DeepSeek-native routed experts (e2m1 + ue8m0 per 32 inputs).
- :mod:`.nvfp4`: NVIDIA ModelOpt routed experts (e2m1 + e4m3 per 16 inputs + fp32 global scale).
- :mod:`.names`: native <-> HF transformers tensor names, and which tensors hold the scales.

Packed forms stay plain tensors (uint8/int8 bytes, float8 scales) so GPU kernels can take them
as they are; every function here works on CPU and CUDA tensors alike. Format facts and their
sources are in each module's docstring (shared/reference/deepseek-v4.md §1, §2, §6, §7).
"""

from __future__ import annotations

from kvrelay.quant.fp4 import (
    E2M1_MAX,
    E2M1_VALUES,
    decode_e2m1,
    dequantize_fp4_ue8m0,
    e2m1_lut,
    encode_e2m1,
    fake_quant_fp4,
    pack_e2m1,
    quantize_fp4_ue8m0,
    unpack_e2m1,
)
from kvrelay.quant.fp8_block import (
    DEFAULT_WEIGHT_BLOCK,
    FP8_E4M3_MAX,
    ScaleFormat,
    ceil_log2,
    dequantize_fp8_block,
    dequantize_fp8_ue8m0,
    e4m3_to_float,
    encode_ue8m0,
    fake_quant_fp8_ue8m0,
    quantize_fp8_block,
    quantize_fp8_ue8m0,
    ue8m0_to_float,
)
from kvrelay.quant.mxfp4 import MXFP4_BLOCK, dequantize_mxfp4, quantize_mxfp4
from kvrelay.quant.names import (
    ExpertSlot,
    QuantFormat,
    UnmappedNameError,
    expert_slot,
    hf_expert_to_native,
    hf_to_native,
    native_to_hf,
    scale_name_for,
    scale_names_for,
    weight_name_for_scale,
)
from kvrelay.quant.nvfp4 import NVFP4_BLOCK, NvFp4Weight, dequantize_nvfp4, quantize_nvfp4

__all__ = [
    "DEFAULT_WEIGHT_BLOCK",
    "E2M1_MAX",
    "E2M1_VALUES",
    "FP8_E4M3_MAX",
    "MXFP4_BLOCK",
    "NVFP4_BLOCK",
    "ExpertSlot",
    "NvFp4Weight",
    "QuantFormat",
    "ScaleFormat",
    "UnmappedNameError",
    "ceil_log2",
    "decode_e2m1",
    "dequantize_fp4_ue8m0",
    "dequantize_fp8_block",
    "dequantize_fp8_ue8m0",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "e2m1_lut",
    "e4m3_to_float",
    "encode_e2m1",
    "encode_ue8m0",
    "expert_slot",
    "fake_quant_fp4",
    "fake_quant_fp8_ue8m0",
    "hf_expert_to_native",
    "hf_to_native",
    "native_to_hf",
    "pack_e2m1",
    "quantize_fp4_ue8m0",
    "quantize_fp8_block",
    "quantize_fp8_ue8m0",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "scale_name_for",
    "scale_names_for",
    "ue8m0_to_float",
    "unpack_e2m1",
    "weight_name_for_scale",
]
