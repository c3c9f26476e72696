"""FLOPs per token of DeepSeek-V4 from its shapes (issue 21: prefill against the bf16 matmul
peak), and the measured peak itself.

GEMMs: every token multiplies each weight matrix it passes once (2 FLOPs per weight), the routed
experts only for its k experts (3 matrices of H x I each), the shared expert(s) and every
attention, indexer, compressor and mHC projection always. Not counted: the embedding (a lookup)
and the head (prefill computes logits for the sampled rows only). Attention: per head, QK and PV
over the entries a token attends to (its sliding window, CSA's top-k compressed entries or HCA's
compressed entries up to its position), and the indexer's scores over the CSA entries before it;
averaged over a prompt of n tokens from position 0 (a token at position t sees t / ratio
entries)."""

from __future__ import annotations

import time

import torch

from kvrelay.models.deepseek_v4.config import CSA, HCA


def gemm_flops_per_token(model) -> float:
    cfg = model.config
    dense = 0
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.dim() != 2 or ".experts." in name or ".mtp." in name:
            continue
        if "embed" in name or "lm_head" in name:
            continue
        if "scale" in name:
            continue  # quantization scales (FP8 blocks, FP4 groups)
        dense += p.numel() * (2 if p.dtype == torch.uint8 else 1)  # uint8: two FP4 codes each
    routed = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok
    return 2.0 * (dense + len(cfg.layer_types) * routed)


def attention_flops_per_token(cfg, n: int) -> float:
    """Mean over the positions 0..n-1 of a prompt of n tokens."""
    h, d, t = cfg.num_attention_heads, cfg.head_dim, n / 2  # t: the mean position
    per = 0.0
    for kind in cfg.layer_types:
        entries = min(cfg.sliding_window, t)
        if kind == CSA:
            entries += min(cfg.index_topk, t / cfg.csa_compress_ratio)
            per += 2 * cfg.index_n_heads * cfg.index_head_dim * t / cfg.csa_compress_ratio
        elif kind == HCA:
            entries += t / cfg.hca_compress_ratio
        per += 4 * h * d * entries  # QK and PV
    return per


def matmul_peak_tflops(device: str = "cuda", n: int = 8192, reps: int = 20) -> float:
    """bf16 n x n x n matmuls back to back, as cuBLAS runs them: the peak prefill is held to."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12
