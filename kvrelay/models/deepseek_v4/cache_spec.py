"""DeepSeek-V4's cache spec: every tensor of its paged pool (cache_pool.py), by name, per page
or per state slot, in the order a PD transfer lists them.

Per layer: the window KV (`swa_kv`, every token's row; a request continuing at token t reads
the last window - 1 of them); compressed layers: the entries (`c{r}_kv`, a row per r tokens)
and the compressor's per-request state (`c{r}_state.*`); CSA layers also the indexer's keys
(`c{r}_index_k`, fp8 with `_scale`) and its compressor's state. A state slot holds two windows'
rows, row = position % 2r (`pending_*`: the projected rows; `prev_*`, overlapping compressors:
each closed window's first halves), so that rows a rejected draft writes never land on rows the
committed tokens still need (speculation needs no rollback: cache_pool.py). The overlapping
(ratio-4) compressors keep their prev state at each page end too (`*.page_prev_*`, one row of
page_size tokens a page, read only by a request resuming at that page's end).
"""

from __future__ import annotations

import math

import torch

from kvrelay.cache.spec import PAGE, SLOT, CacheSpec, KindSpec
from kvrelay.config import INDEX_K_DTYPES
from kvrelay.kernels.precision import wide_dtype
from kvrelay.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config

FP8 = torch.float8_e4m3fn


def dsv4_page_size(cfg: DeepseekV4Config, requested: int) -> int:
    """The smallest multiple of every compress ratio that is >= the requested page size."""
    unit = math.lcm(cfg.csa_compress_ratio, cfg.hca_compress_ratio)
    return unit * max(1, -(-requested // unit))


def dsv4_cache_spec(
    cfg: DeepseekV4Config,
    page_size: int,
    dtype: torch.dtype,
    index_k_dtype: str = "auto",
    mtp_layers: int = 0,
) -> CacheSpec:
    """Every cache tensor of the model (and with `mtp_layers`, the sliding-window rows of its
    MTP blocks, which drafting with them needs: `MTP{j}.swa_kv`, layer index L + j)."""
    if page_size % math.lcm(cfg.csa_compress_ratio, cfg.hca_compress_ratio):
        raise ValueError("page_size must be a multiple of every compress ratio")
    if index_k_dtype not in INDEX_K_DTYPES:
        raise ValueError(f"index_k_dtype must be one of {INDEX_K_DTYPES}")
    wide, d, di, P = wide_dtype(dtype), cfg.head_dim, cfg.index_head_dim, page_size
    kinds: list[KindSpec] = []

    def state(prefix: str, layer: int, ratio: int, dim: int, overlap: bool) -> None:
        coff = 2 if overlap else 1
        for part in ("pending_kv", "pending_score"):
            kinds.append(KindSpec(f"{prefix}.{part}", SLOT, layer, (2 * ratio, coff * dim), wide))
        if overlap:
            for part in ("prev_kv", "prev_score"):
                kinds.append(KindSpec(f"{prefix}.{part}", SLOT, layer, (2 * ratio, dim), wide))
            for part in ("page_prev_kv", "page_prev_score"):  # one row per page
                kinds.append(KindSpec(f"{prefix}.{part}", PAGE, layer, (1, ratio, dim), wide, P, P))

    for i, kind in enumerate(cfg.layer_types):
        kinds.append(
            KindSpec(f"L{i}.swa_kv", PAGE, i, (P, d), dtype, keep_last=cfg.sliding_window - 1)
        )
        if kind != SLIDING:
            r = cfg.compress_ratio(i)
            kinds.append(KindSpec(f"L{i}.c{r}_kv", PAGE, i, (P // r, d), dtype, r))
            state(f"L{i}.c{r}_state", i, r, d, kind == CSA)
        if kind == CSA:
            r = cfg.csa_compress_ratio
            fp8 = index_k_dtype == "fp8"
            kinds.append(
                KindSpec(f"L{i}.c{r}_index_k", PAGE, i, (P // r, di), FP8 if fp8 else dtype, r)
            )
            if fp8:
                kinds.append(
                    KindSpec(f"L{i}.c{r}_index_k_scale", PAGE, i, (P // r,), torch.float32, r)
                )
            state(f"L{i}.c{r}_index_state", i, r, di, True)
    n = len(cfg.layer_types)
    for j in range(mtp_layers):
        kinds.append(
            KindSpec(f"MTP{j}.swa_kv", PAGE, n + j, (P, d), dtype, keep_last=cfg.sliding_window - 1)
        )
    return CacheSpec(page_size, tuple(kinds))
