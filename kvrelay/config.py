"""Frozen configuration dataclasses and the one registry of KVRELAY_* environment knobs."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """A dense Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * h * i + 2 * h
        if self.qk_norm:
            layer += 2 * self.head_dim
        if self.attention_bias:
            layer += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        head = 0 if self.tie_word_embeddings else v * h
        return self.num_layers * layer + v * h + head + h


INDEX_K_DTYPES = ("auto", "fp8")  # DeepSeek-V4 index keys; auto: the model dtype (bf16 on GPU)


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    max_total_tokens: int | None = None  # None: sized from free memory
    memory_fraction: float = 0.85  # of free device memory (GPU) or available RAM x 0.3 (CPU)
    index_k_dtype: str = "auto"  # DeepSeek-V4 index keys: auto (model dtype) | fp8 (+ row scale)
    # Radix prefix cache over token ids (off for DeepSeek-V4 under tensor parallel).
    prefix_cache: bool = True
    # GiB of host memory for prefix pages evicted from the device (0: evicted pages are dropped).
    host_cache_gb: float = 0.0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_running_requests: int = 256
    # Admission reserves KV for this fraction of each request's remaining max_tokens,
    # so that running requests cannot run out; below 1.0, preemption covers the rest.
    kv_reserve_ratio: float = 1.0
    # ... but for at most this many output tokens: a request without max_tokens (the whole
    # context) must not hold the pool. Beyond it KV grows on demand (preemption if it runs dry).
    kv_reserve_max_tokens: int = 256
    # While requests decode, a step's prefill tokens keep it within this many times a
    # decode-only step (measured online, engine/step_budget.py); 0: off (the whole budget).
    max_decode_slowdown: float = 0.0


SPECULATIVE_ALGORITHMS = ("none", "ngram", "mtp")  # mtp: DeepSeek-V4's own MTP block
# The CLI's K for mtp when none is given: chains pay more on the agent (tokens per verify step
# 2.00 / 2.74 / 3.44 / 3.94 at K = 1..4, benchmarks/mtp_chain_acceptance.py), and with graphs
# on an H200 in bf16 K = 4 gave the lowest time per token at concurrency 1, 8 and 64 (2026-12-07,
# benchmarks/spec_decode.py). 4 is also DeepSeek-V4's limit (its smallest compress ratio).
MTP_DEFAULT_DRAFTS = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/drafter.py): drafts verified by the target in one step."""

    algorithm: str = "none"  # none | ngram (prompt lookup) | mtp (DeepSeek-V4's MTP block)
    num_draft_tokens: int = 4  # drafts per request per step at most (mtp: its block chained)
    # n-gram window sizes: the longest suffix of the context (max down to min tokens) that
    # occurred earlier proposes what followed it.
    ngram_min: int = 1
    ngram_max: int = 4
    # mtp: a safetensors file of the model's MTP block (`model.mtp.*`) for a checkpoint that
    # has none (e.g. tests/data/dsv4-tiny-agent-mtp.safetensors for the tiny agent)
    draft_model_path: str = ""
    # Draft only while fewer requests than this decode (0: always): at a large batch a verify
    # step's extra rows cost more than the tokens they win (benchmarks/spec_decode.py).
    disable_batch_size: int = 0

    @property
    def rows_per_request(self) -> int:
        """A request's rows in a step that a verify graph must hold: its last token and K drafts
        (1 without speculation)."""
        return 1 if self.algorithm == "none" else 1 + self.num_draft_tokens


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill-decode disaggregation (used when role is prefill or decode)."""

    transfer_backend: str = "tcp"
    transfer_host: str = "127.0.0.1"  # decode: where the transfer listener binds
    transfer_port: int = 0  # decode: 0 picks a free port
    checksum: bool = True  # crc32 over every transferred piece, verified before install
    layers_per_chunk: int = 8  # layers per transferred KV piece
    connect_timeout_s: float = 10.0
    bootstrap_timeout_s: float = (
        30.0  # reservation handshake; also prefill waiting for decode's done
    )
    transfer_timeout_s: float = 300.0  # prefill queue + compute + transfer, as seen from each side
    heartbeat_interval_s: float = 2.0  # each side pings every peer connection this often
    heartbeat_timeout_s: float = 10.0  # a peer silent this long is dropped and its transfers fail
    # The secret PD peers and the router share: the transfer handshake and the PD fields of a
    # request are authenticated with it. "": no PD at all (peers and PD fields are refused).
    pd_secret: str = field(default="", repr=False)
    # TEST ONLY (prefill): corrupt a request's first KV piece after checksumming, with this probability.
    test_corrupt_p: float = 0.0
    # TEST ONLY (prefill): send every KV piece and first token this many seconds late.
    test_delay_transfer_s: float = 0.0

    # Transfer backends that need an optional package: backend -> (its module, how to get it).
    OPTIONAL_BACKENDS = {"nixl": ("nixl_cu13", "pip install 'kvrelay[nixl]' (nixl-cu13)")}

    @staticmethod
    def backend_problem(name: str) -> str:
        """Why transfer backend `name` cannot run in this environment ("" when it can): its
        optional package is not installed. Looked up, not imported."""
        need = DisaggConfig.OPTIONAL_BACKENDS.get(name)
        if need is None or importlib.util.find_spec(need[0]) is not None:
            return ""
        return f"the {name} transfer backend needs the {need[0]} package: {need[1]}"


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"
    load_format: str = "auto"  # auto | gguf | safetensors | dummy
    tokenizer: str | None = None  # HF tokenizer directory overriding the model's
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"
    attention_backend: str = "auto"  # auto: triton on GPU, torch elsewhere; reference (DSV4 oracle)
    # DeepSeek-V4 attention and shared-expert weights: auto (the model dtype) | fp8 (128x128 blocks)
    linear_weights: str = "auto"
    cuda_graphs: bool = True
    max_cuda_graph_batch: int = 256
    # Time attention / MLP or MoE / communication / other on every N-th step; 0: off.
    step_profile_every: int = 0
    # Batch-invariant ops (layers/batch_invariant.py): a request's logits are bitwise the same
    # whatever else is in its batch and however its prompt was chunked. CPU torch path only.
    deterministic: bool = False
    max_model_len: int | None = None
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Test-only: swap a sampled token with probability p when the batch is larger than k.
    fault_swap_token_p: float = 0.0
    fault_swap_token_min_batch: int = 0
    # Test-only: from the N-th batch step on, every forward raises, as after a sticky CUDA error.
    fault_sticky_error_after: int = 0
    # Test-only: sleep this long in every batch step (a slow server: overload and slow-peer tests).
    test_step_delay_s: float = 0.0
    role: str = "single"  # single | prefill | decode
    # Ranks of one engine: rank 0 schedules and broadcasts each step's batch.
    tensor_parallel_size: int = 1
    # DeepSeek-V4 under TP: routed experts split by expert (E/N per rank), not by intermediate dim.
    expert_parallel: bool = False
    # Expert parallel: one all-reduce per MoE ("all-reduce"), or each rank's tokens dispatched to
    # their experts' ranks and back, then all-gathered ("all-to-all": deepseek_v4/ep_dispatch.py).
    ep_dispatch: str = "all-reduce"
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413 (chunked ones too)
    max_n: int = 16  # samples per request (n); each is one engine request
    # Sampling defaults for what a request leaves out: "auto" (the model's generation_config.json,
    # or the model card's for the embedded SmolLM2), "openai" (temperature 1, top_p 1), or a
    # directory holding a generation_config.json.
    generation_config: str = "auto"
    request_timeout_s: float = 600.0
    api_key: str = field(default="", repr=False)  # "": no key; else `Authorization: Bearer KEY`
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    max_attempts: int = 2  # a retry picks a fresh pair, and only while nothing was streamed
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413 (chunked ones too)
    # Requests in flight at most; past it a 503 with Retry-After (connection pools are sized to it).
    max_concurrent_requests: int = 4096
    probe_interval_s: float = 1.0  # each server's /ready, this often, in the background
    policy: str = "cache_aware"  # which pair a request goes to (router/policy.py)
    api_key: str = field(default="", repr=False)  # asked of clients, and sent to the servers
    pd_secret: str = field(default="", repr=False)  # signs the PD fields of its requests


# Settings whose values are never shown (server_info, the ledger, logs): only whether they are set.
SECRET_SETTINGS = frozenset({"api_key", "pd_secret"})


def redacted(d: dict) -> dict:
    """A config dict (dataclasses.asdict) with every secret replaced by "<set>" (or "" if unset)."""
    out = {}
    for k, v in d.items():
        if k in SECRET_SETTINGS:
            out[k] = "<set>" if v else ""
        else:
            out[k] = redacted(v) if isinstance(v, dict) else v
    return out


@dataclass(frozen=True)
class EnvKnob:
    name: str
    default: str
    help: str
    secret: bool = False  # its value is never shown, only whether it is set

    def get(self) -> str:
        return os.environ.get(self.name, self.default)


ENV_KNOBS: dict[str, EnvKnob] = {
    k.name: k
    for k in (
        EnvKnob("KVRELAY_LOG_LEVEL", "INFO", "log level of every kvrelay process"),
        EnvKnob("KVRELAY_ENGINE_START_TIMEOUT_S", "600", "seconds to wait for the engine to load"),
        EnvKnob(
            "KVRELAY_READY_STALL_S",
            "10",
            "a server whose engine loop is silent longer than this (and than 10x its longest "
            "recent step) reports /ready 503; 0: never",
        ),
        EnvKnob(
            "KVRELAY_ENGINE_STALL_S",
            "120",
            "a server whose engine loop is silent longer than this (and than 50x its longest "
            "recent step) reports /health 503, and `kvrelay up` restarts it; 0: never",
        ),
        EnvKnob(
            "KVRELAY_HTTP_HEADER_TIMEOUT_S",
            "10",
            "server and router close a connection whose request headers are not complete this "
            "many seconds after it opened (or after a kept-alive request's first byte)",
        ),
        EnvKnob(
            "KVRELAY_HTTP_BODY_TIMEOUT_S",
            "30",
            "server and router close a connection whose request body is not complete this many "
            "seconds after its headers",
        ),
        EnvKnob(
            "KVRELAY_HTTP_MAX_PENDING",
            "1024",
            "server and router close a new connection at once while this many wait for their "
            "request headers",
        ),
        EnvKnob(
            "KVRELAY_PD_REQUEST_WINDOW_S",
            "60",
            "a server takes a router-signed PD request this many seconds either side of its "
            "signing time (the clocks of router and server may differ that much), once",
        ),
        EnvKnob(
            "KVRELAY_ENGINE_DEATH_EXIT_S",
            "2",
            "a `kvrelay serve` whose engine process died exits with code 3 this many seconds "
            "later (its in-flight requests failed, /health saying why meanwhile), so that its "
            "supervisor (systemd, Kubernetes, `kvrelay up`) restarts it; 0: stay up, 503",
        ),
        EnvKnob(
            "KVRELAY_HEALTH_MAX_FAILED_STEPS",
            "3",
            "a server's /health answers 503 once this many engine steps in a row have failed "
            "(a sticky device error fails every step while the process lives)",
        ),
        EnvKnob(
            "KVRELAY_UP_UNHEALTHY_S",
            "5",
            "`kvrelay up` restarts a child whose /health has answered 503 for this many seconds "
            "since it was last healthy (a dead engine, steps failing, a stalled engine loop)",
        ),
        EnvKnob(
            "KVRELAY_UP_UNRESPONSIVE_S",
            "30",
            "`kvrelay up` restarts a child whose /health has not answered at all for this many "
            "seconds (a hung process; a busy one answers, if late)",
        ),
        EnvKnob(
            "KVRELAY_UP_MAX_RESTARTS",
            "5",
            "`kvrelay up` gives up (stops the stack, exit 1) when one child needs more restarts "
            "than this within KVRELAY_UP_RESTART_WINDOW_S",
        ),
        EnvKnob(
            "KVRELAY_UP_RESTART_WINDOW_S",
            "600",
            "seconds over which KVRELAY_UP_MAX_RESTARTS counts",
        ),
        EnvKnob(
            "KVRELAY_UP_RESTART_SCOPE",
            "server",
            "what `kvrelay up` restarts when a server fails: 'server' (that one alone: peers carry "
            "instance ids, so the other side re-bootstraps) or 'stack' (prefill, decode and "
            "router together)",
        ),
        EnvKnob(
            "KVRELAY_TP_TIMEOUT_S",
            "600",
            "seconds a tensor-parallel rank waits in a collective for the other ranks",
        ),
        EnvKnob(
            "KVRELAY_CPU_THREADS", "0", "torch threads in the engine on CPU (0: torch default)"
        ),
        EnvKnob(
            "KVRELAY_CACHE_DIR",
            "~/.cache/kvrelay",
            "where converted artefacts are kept between starts (a GGUF model's tokenizer and "
            "dequantized weights); 'off': keep nothing",
        ),
        EnvKnob(
            "KVRELAY_WEIGHT_CACHE_MAX_GB",
            "4",
            "a GGUF model's weights as served (dequantized, in the served dtype) are kept under "
            "KVRELAY_CACHE_DIR up to this size, and later starts map them instead of "
            "dequantizing; 0: never",
        ),
        EnvKnob(
            "KVRELAY_LEDGER",
            "~/.kvrelay/ledger.db",
            "SQLite run ledger of bench/verify/ab/repro (--ledger overrides; 'off': record nothing)",
        ),
        EnvKnob(
            "KVRELAY_API_KEY",
            "",
            "API key of `serve` and `router` when --api-key is not given (clients send "
            "`Authorization: Bearer KEY`; /health and /metrics stay open); bench, verify, repro "
            "and ab send it",
            secret=True,
        ),
        EnvKnob(
            "KVRELAY_PD_SECRET",
            "",
            "PD shared secret of `serve` and `router` when neither --pd-secret nor "
            "--pd-secret-file is given (`kvrelay up` sets it for its stack)",
            secret=True,
        ),
    )
}


def env(name: str) -> str:
    return ENV_KNOBS[name].get()


def env_snapshot() -> dict[str, str]:
    """The value of every knob as this process sees it (recorded with benchmark runs); a secret
    knob shows only whether it is set."""
    return {
        name: ("<set>" if k.get() else "") if k.secret else k.get() for name, k in ENV_KNOBS.items()
    }


def api_key_headers() -> dict[str, str]:
    """What a kvrelay client (bench, verify, repro, ab, the ledger) sends to a server or router:
    the KVRELAY_API_KEY of its environment as a bearer token, when one is set."""
    key = env("KVRELAY_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def env_help() -> str:
    return "\n".join(f"  {k.name} (default {k.default!r}): {k.help}" for k in ENV_KNOBS.values())
