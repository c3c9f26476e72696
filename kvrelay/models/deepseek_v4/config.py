"""DeepSeek-V4 configuration: one frozen dataclass, parsed from HF or DeepSeek-native config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"  # ratio-4 overlapping windows + lightning indexer
HCA = "heavily_compressed_attention"  # ratio-128 disjoint windows, every entry visible
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"


@dataclass(frozen=True)
class DeepseekV4Config:
    """Shapes and hyper-parameters of a DeepSeek-V4 model. Defaults are DeepSeek-V4-Flash."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    # Attention kind per layer; CSA layers compress with `csa_compress_ratio` (overlapping
    # windows of twice the ratio), HCA layers with `hca_compress_ratio` (disjoint windows).
    layer_types: tuple[str, ...] = field(
        default_factory=lambda: (SLIDING, SLIDING) + (CSA, HCA) * 20 + (CSA,)
    )
    csa_compress_ratio: int = 4
    hca_compress_ratio: int = 128
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # RoPE: sliding layers use `rope_theta` plainly; compressed layers use
    # `compress_rope_theta` with YaRN (`rope_factor` > 1), cos/sin magnitude 1.
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    rope_original_max_position: int = 65536
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    # MoE
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    mlp_layer_types: tuple[str, ...] = field(default_factory=lambda: (HASH_MOE,) * 3 + (MOE,) * 40)
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0  # <= 0 disables the clamp
    # mHC residual streams
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    # The reference simulates its FP8 KV cache (e4m3, block 64, ue8m0 scales, nope dims) and
    # FP4 index keys/queries (Hadamard, e2m1, block 32) in the forward (QAT numerics). HF
    # transformers does not; turn this off to compare with it.
    qat_simulation: bool = True
    # How the routed experts are held in memory: dense in the model dtype, or packed NVFP4
    # (dequantized per expert on use). A serving choice, not part of HF's config. The MTP
    # block's experts may differ (NVIDIA's NVFP4 checkpoints keep them MXFP4): None = the same.
    expert_format: str = "dense"
    mtp_expert_format: str | None = None

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise ValueError(
                f"layer_types ({len(self.layer_types)}) and mlp_layer_types "
                f"({len(self.mlp_layer_types)}) must have num_hidden_layers={n} entries"
            )
        if bad := [t for t in self.layer_types if t not in LAYER_TYPES]:
            raise ValueError(f"unknown layer types {bad}")
        if bad := [t for t in self.mlp_layer_types if t not in (HASH_MOE, MOE)]:
            raise ValueError(f"unknown mlp layer types {bad}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(
            self.head_dim, self.index_head_dim
        ):
            raise ValueError("qk_rope_head_dim must be even and fit in head_dim and index_head_dim")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError("num_attention_heads * head_dim must divide into o_groups")
        for fmt in (self.expert_format, self.mtp_expert_format or "dense"):
            if fmt not in ("dense", "nvfp4", "mxfp4"):
                raise ValueError(f"unknown expert format {fmt!r} (dense | nvfp4 | mxfp4)")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"unknown scoring_func {self.scoring_func!r}")
        if self.qat_simulation:
            if self.nope_head_dim % 64:
                raise ValueError("QAT simulation needs head_dim - qk_rope_head_dim divisible by 64")
            if self.index_head_dim % 32 or self.index_head_dim & (self.index_head_dim - 1):
                raise ValueError("QAT simulation needs a power-of-two index_head_dim >= 32")

    # -- derived -------------------------------------------------------------------------
    # The names the engine reads from any model config.
    architecture = "DeepseekV4ForCausalLM"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return () if self.eos_token_id is None else (self.eos_token_id,)

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def num_hash_layers(self) -> int:
        return sum(t == HASH_MOE for t in self.mlp_layer_types)

    def compress_ratio(self, layer: int) -> int:
        """0 for sliding-only layers, else the number of tokens per compressed entry."""
        kind = self.layer_types[layer]
        return {SLIDING: 0, CSA: self.csa_compress_ratio, HCA: self.hca_compress_ratio}[kind]

    def with_(self, **changes: Any) -> DeepseekV4Config:
        return replace(self, **changes)

    # -- parsing -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepseekV4Config:
        """Parse an HF-transformers config.json or a DeepSeek-native inference/config.json."""
        if "dim" in d or "n_layers" in d:
            return cls._from_native(d)
        return cls._from_hf(d)

    @classmethod
    def _from_hf(cls, d: dict[str, Any]) -> DeepseekV4Config:
        dflt = cls()
        n = d.get("num_hidden_layers", dflt.num_hidden_layers)
        rates = dict(d.get("compress_rates") or {})
        csa = int(d.get("compress_rate_csa", rates.get(CSA, 4)))
        hca = int(d.get("compress_rate_hca", rates.get(HCA, 128)))
        if d.get("layer_types") is not None:
            layer_types = tuple(d["layer_types"])[:n]
        elif d.get("compress_ratios") is not None:
            layer_types = _ratios_to_types(d["compress_ratios"][:n], csa)
        else:  # HF's default schedule (V4-Pro style): two HCA layers, then CSA/HCA interleaved
            layer_types = ((HCA,) * min(n, 2) + tuple(CSA if i % 2 else HCA for i in range(n - 2)))[
                :n
            ]
        if d.get("mlp_layer_types") is not None:
            mlp_types = tuple(d["mlp_layer_types"])[:n]
        else:
            n_hash = min(n, int(d.get("num_hash_layers", 3)))
            mlp_types = (HASH_MOE,) * n_hash + (MOE,) * (n - n_hash)
        head_dim = d.get("head_dim", dflt.head_dim)
        if d.get("qk_rope_head_dim") is not None:
            rope_dim = int(d["qk_rope_head_dim"])
        elif d.get("partial_rotary_factor") is not None:
            rope_dim = round(head_dim * d["partial_rotary_factor"])
        else:
            rope_dim = 64
        rope_theta, compress_theta, yarn = _hf_rope(d, dflt)
        max_pos = d.get("max_position_embeddings", dflt.max_position_embeddings)
        factor = yarn.get("factor") if yarn else 1.0
        if yarn and factor is None:  # HF derives it from the two lengths
            factor = max_pos / yarn["original_max_position_embeddings"]
        eos = d.get("eos_token_id", dflt.eos_token_id)
        return cls(
            vocab_size=d.get("vocab_size", dflt.vocab_size),
            hidden_size=d.get("hidden_size", dflt.hidden_size),
            num_hidden_layers=n,
            num_attention_heads=d.get("num_attention_heads", dflt.num_attention_heads),
            head_dim=head_dim,
            qk_rope_head_dim=rope_dim,
            q_lora_rank=d.get("q_lora_rank", dflt.q_lora_rank),
            o_groups=d.get("o_groups", dflt.o_groups),
            o_lora_rank=d.get("o_lora_rank", dflt.o_lora_rank),
            layer_types=layer_types,
            csa_compress_ratio=csa,
            hca_compress_ratio=hca,
            sliding_window=d.get("sliding_window", dflt.sliding_window),
            index_n_heads=d.get("index_n_heads", dflt.index_n_heads),
            index_head_dim=d.get("index_head_dim", dflt.index_head_dim),
            index_topk=d.get("index_topk", dflt.index_topk),
            rope_theta=float(rope_theta),
            compress_rope_theta=float(compress_theta),
            rope_factor=float(factor),
            rope_original_max_position=int(
                yarn.get("original_max_position_embeddings", max_pos) if yarn else max_pos
            ),
            rope_beta_fast=float((yarn or {}).get("beta_fast") or 32.0),
            rope_beta_slow=float((yarn or {}).get("beta_slow") or 1.0),
            max_position_embeddings=max_pos,
            n_routed_experts=d.get("n_routed_experts", dflt.n_routed_experts),
            n_shared_experts=d.get("n_shared_experts", dflt.n_shared_experts),
            num_experts_per_tok=d.get("num_experts_per_tok", dflt.num_experts_per_tok),
            moe_intermediate_size=d.get("moe_intermediate_size", dflt.moe_intermediate_size),
            mlp_layer_types=mlp_types,
            scoring_func=d.get("scoring_func", dflt.scoring_func),
            norm_topk_prob=d.get("norm_topk_prob", dflt.norm_topk_prob),
            routed_scaling_factor=d.get("routed_scaling_factor", dflt.routed_scaling_factor),
            swiglu_limit=d.get("swiglu_limit", dflt.swiglu_limit),
            hc_mult=d.get("hc_mult", dflt.hc_mult),
            hc_sinkhorn_iters=d.get("hc_sinkhorn_iters", dflt.hc_sinkhorn_iters),
            hc_eps=d.get("hc_eps", dflt.hc_eps),
            rms_norm_eps=d.get("rms_norm_eps", dflt.rms_norm_eps),
            num_nextn_predict_layers=d.get("num_nextn_predict_layers", 1),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id", dflt.bos_token_id),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            qat_simulation=d.get("qat_simulation", True),
        )

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> DeepseekV4Config:
        dflt = cls()
        n = d.get("n_layers", dflt.num_hidden_layers)
        ratios = d.get("compress_ratios")
        layer_types = _ratios_to_types(ratios[:n], 4) if ratios else dflt.layer_types
        hca = sorted({r for r in (ratios or [])[:n] if r not in (0, 4)}) or [128]
        if len(hca) > 1:
            raise ValueError(f"more than one heavy compression ratio: {hca}")
        n_hash = min(n, d.get("n_hash_layers", 3))
        original = int(d.get("original_seq_len", dflt.rope_original_max_position))
        factor = float(d.get("rope_factor", dflt.rope_factor))
        return cls(
            vocab_size=d.get("vocab_size", dflt.vocab_size),
            hidden_size=d.get("dim", dflt.hidden_size),
            num_hidden_layers=n,
            num_attention_heads=d.get("n_heads", dflt.num_attention_heads),
            head_dim=d.get("head_dim", dflt.head_dim),
            qk_rope_head_dim=d.get("rope_head_dim", dflt.qk_rope_head_dim),
            q_lora_rank=d.get("q_lora_rank", dflt.q_lora_rank),
            o_groups=d.get("o_groups", dflt.o_groups),
            o_lora_rank=d.get("o_lora_rank", dflt.o_lora_rank),
            layer_types=layer_types,
            csa_compress_ratio=4,
            hca_compress_ratio=hca[0],
            sliding_window=d.get("window_size", dflt.sliding_window),
            index_n_heads=d.get("index_n_heads", dflt.index_n_heads),
            index_head_dim=d.get("index_head_dim", dflt.index_head_dim),
            index_topk=d.get("index_topk", dflt.index_topk),
            rope_theta=float(d.get("rope_theta", dflt.rope_theta)),
            compress_rope_theta=float(d.get("compress_rope_theta", dflt.compress_rope_theta)),
            # original_seq_len == 0 is the reference's way of switching YaRN off
            rope_factor=factor if original > 0 else 1.0,
            rope_original_max_position=original
            if original > 0
            else dflt.rope_original_max_position,
            rope_beta_fast=float(d.get("beta_fast", dflt.rope_beta_fast)),
            rope_beta_slow=float(d.get("beta_slow", dflt.rope_beta_slow)),
            max_position_embeddings=d.get("max_seq_len", dflt.max_position_embeddings),
            n_routed_experts=d.get("n_routed_experts", dflt.n_routed_experts),
            n_shared_experts=d.get("n_shared_experts", dflt.n_shared_experts),
            num_experts_per_tok=d.get("n_activated_experts", dflt.num_experts_per_tok),
            moe_intermediate_size=d.get("moe_inter_dim", dflt.moe_intermediate_size),
            mlp_layer_types=(HASH_MOE,) * n_hash + (MOE,) * (n - n_hash),
            scoring_func=d.get("score_func", dflt.scoring_func),
            routed_scaling_factor=d.get("route_scale", dflt.routed_scaling_factor),
            swiglu_limit=d.get("swiglu_limit", dflt.swiglu_limit),
            hc_mult=d.get("hc_mult", dflt.hc_mult),
            hc_sinkhorn_iters=d.get("hc_sinkhorn_iters", dflt.hc_sinkhorn_iters),
            hc_eps=d.get("hc_eps", dflt.hc_eps),
            rms_norm_eps=d.get("norm_eps", dflt.rms_norm_eps),
            num_nextn_predict_layers=d.get("n_mtp_layers", 1),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF-transformers config.json for this config (qat_simulation is not an HF notion)."""
        partial = self.qk_rope_head_dim / self.head_dim
        compress: dict[str, Any] = {
            "rope_type": "default",
            "rope_theta": self.compress_rope_theta,
            "partial_rotary_factor": partial,
        }
        if self.rope_factor > 1:
            compress |= {
                "rope_type": "yarn",
                "factor": self.rope_factor,
                "original_max_position_embeddings": self.rope_original_max_position,
                "beta_fast": self.rope_beta_fast,
                "beta_slow": self.rope_beta_slow,
                "attention_factor": 1.0,  # V4 does not scale cos/sin (no YaRN mscale)
            }
        return {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "partial_rotary_factor": partial,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "layer_types": list(self.layer_types),
            "compress_rates": {CSA: self.csa_compress_ratio, HCA: self.hca_compress_ratio},
            "sliding_window": self.sliding_window,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_parameters": {
                "main": {
                    "rope_type": "default",
                    "rope_theta": self.rope_theta,
                    "partial_rotary_factor": partial,
                },
                "compress": compress,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "mlp_layer_types": list(self.mlp_layer_types),
            "scoring_func": self.scoring_func,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "hidden_act": "silu",
        }

    # -- sizes ---------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        """Parameters of the main model (embeddings, layers, head), without the MTP block."""
        h, hd, nh = self.hidden_size, self.head_dim, self.num_attention_heads
        attn = (
            h * self.q_lora_rank
            + self.q_lora_rank * nh * hd
            + h * hd
            + nh * hd * self.o_lora_rank
            + self.o_groups * self.o_lora_rank * h
        )
        moe = (self.n_routed_experts + self.n_shared_experts) * 3 * h * self.moe_intermediate_size
        moe += self.n_routed_experts * h
        total = 0
        for i in range(self.num_hidden_layers):
            total += attn + moe
            r = self.compress_ratio(i)
            if r:
                coff = 2 if self.layer_types[i] == CSA else 1
                total += 2 * h * coff * hd
            if self.layer_types[i] == CSA:
                idx = self.index_head_dim
                total += 2 * h * 2 * idx + self.q_lora_rank * self.index_n_heads * idx
                total += h * self.index_n_heads
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return total + self.vocab_size * h + head


def _ratios_to_types(ratios: list[int], csa_ratio: int) -> tuple[str, ...]:
    return tuple(SLIDING if r == 0 else CSA if r == csa_ratio else HCA for r in ratios)


def _hf_rope(d: dict[str, Any], dflt: DeepseekV4Config) -> tuple[float, float, dict | None]:
    """(main theta, compress theta, YaRN parameters or None) from any HF rope spelling."""
    rp = d.get("rope_parameters") or {}
    main, comp = rp.get("main"), rp.get("compress")
    if isinstance(main, dict) and isinstance(comp, dict):
        rope_theta = main.get("rope_theta", d.get("rope_theta", dflt.rope_theta))
        compress_theta = comp.get("rope_theta", d.get("compress_rope_theta"))
        scaling = comp
    else:
        rope_theta = d.get("rope_theta", rp.get("rope_theta", dflt.rope_theta))
        compress_theta = d.get("compress_rope_theta")
        scaling = {
            **(d.get("rope_scaling") or {}),
            **{k: v for k, v in rp.items() if k != "rope_theta"},
        }
    if compress_theta is None:
        compress_theta = dflt.compress_rope_theta
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return rope_theta, compress_theta, None
    if kind != "yarn":
        raise ValueError(f"unsupported rope type {kind!r} for DeepSeek-V4")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is not None and not math.isclose(attention_factor, 1.0):
        raise ValueError("DeepSeek-V4 uses YaRN without cos/sin scaling (attention_factor 1.0)")
    yarn = {
        "factor": scaling.get("factor"),
        "original_max_position_embeddings": scaling.get(
            "original_max_position_embeddings", d.get("max_position_embeddings")
        ),
        "beta_fast": scaling.get("beta_fast"),
        "beta_slow": scaling.get("beta_slow"),
    }
    return rope_theta, compress_theta, yarn


# -- presets -------------------------------------------------------------------------------
_FLASH = DeepseekV4Config()

PRESETS: dict[str, DeepseekV4Config] = {
    # The real DeepSeek-V4-Flash shape (284B total, 13B active).
    "dsv4-flash": _FLASH.with_(expert_format="nvfp4"),
    # Flash's per-layer shapes with 20 layers (2 sliding, then CSA/HCA interleaved): one H200
    # holds it with FP4 experts.
    "dsv4-mini": _FLASH.with_(
        expert_format="nvfp4",
        num_hidden_layers=20,
        layer_types=(SLIDING, SLIDING) + (CSA, HCA) * 9,
        mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 17,
    ),
    # The same shapes with 8 layers (~2/5 of dsv4-mini's weights): a prefill and a decode
    # server side by side on one H200, for PD over cuda_ipc at Flash's per-layer sizes.
    "dsv4-mini8": _FLASH.with_(
        expert_format="nvfp4",
        num_hidden_layers=8,
        layer_types=(SLIDING, SLIDING) + (CSA, HCA) * 3,
        mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 5,
    ),
    # For tests: every layer kind and both routers in five small layers. The heavy ratio is
    # 16 (not 128) and the window 16 so that a few hundred tokens fill the window and make
    # several entries of both ratios; index_topk 8 makes the indexer really drop entries.
    "dsv4-tiny": DeepseekV4Config(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        head_dim=96,
        qk_rope_head_dim=32,
        q_lora_rank=48,
        o_groups=2,
        o_lora_rank=32,
        layer_types=(SLIDING, CSA, HCA, CSA, HCA),
        csa_compress_ratio=4,
        hca_compress_ratio=16,
        sliding_window=16,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=8,
        rope_factor=16.0,
        rope_original_max_position=128,
        max_position_embeddings=2048,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_layer_types=(HASH_MOE, HASH_MOE, MOE, MOE, MOE),
    ),
}


def preset(name: str) -> DeepseekV4Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown DeepSeek-V4 preset {name!r}; known: {sorted(PRESETS)}") from None
