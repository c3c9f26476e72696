"""The one command line: serve, router, up, bench, verify."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvrelay.config import (
    INDEX_K_DTYPES,
    MTP_DEFAULT_DRAFTS,
    SPECULATIVE_ALGORITHMS,
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    RouterConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
    env,
    env_help,
)
from kvrelay.models import registry
from kvrelay.ops.open_files import raise_open_files_limit
from kvrelay.router.policy import POLICIES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d, c, s = EngineConfig(), CacheConfig(), SchedulerConfig()
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--model",
        default=d.model,
        help="'smollm2' (embedded SmolLM2-135M-Instruct), a .gguf file, an HF directory, or a dummy preset",
    )
    g.add_argument(
        "--load-format",
        default=d.load_format,
        choices=["auto", "dummy"],
        help=f"'dummy': random weights for a preset ({', '.join(registry.presets())})",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer directory to use instead of the model's (dummy models otherwise "
        "borrow the embedded SmolLM2 tokenizer)",
    )
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    g.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        choices=["auto", "torch", "triton", "reference"],
        help="auto: triton on GPU, torch elsewhere; reference: DeepSeek-V4's per-sequence "
        "oracle path (dense models: torch)",
    )
    g.add_argument(
        "--linear-weights",
        default=d.linear_weights,
        choices=["auto", "fp8"],
        help="DeepSeek-V4 attention and shared-expert weights: auto (the model dtype) or fp8 "
        "(e4m3, one power-of-two scale per 128x128 block, as DeepSeek ships them)",
    )
    g.add_argument("--disable-cuda-graphs", action="store_true", help="run decode eagerly on GPU")
    g.add_argument("--max-cuda-graph-batch", type=int, default=d.max_cuda_graph_batch)
    g.add_argument(
        "--step-profile-every",
        type=int,
        default=d.step_profile_every,
        metavar="N",
        help="split every N-th engine step into attention / mlp or moe / communication / other "
        "(CUDA events, inside a second variant of each CUDA graph, captured now or on first "
        "use) and report it in /telemetry/steps and /metrics; 0: off (POST /telemetry/profile "
        "changes it at run time)",
    )
    g.add_argument(
        "--max-model-len", type=int, default=None, help="context limit (default: the model's)"
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant mode: a request's logits and seeded samples are bitwise the same "
        "at any concurrency and any prefill chunking (fixed-shape matmuls, reductions and "
        "attention blocks; slower; on the GPU the Triton path with invariant schedules)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=d.tensor_parallel_size,
        metavar="N",
        help="ranks of one engine (gloo on CPU, NCCL on GPU; DeepSeek-V4: CPU only, so far): "
        "rank 0 schedules and broadcasts each step; each rank holds 1/N of the heads, MLP, "
        "vocabulary and (dense) KV",
    )
    g.add_argument(
        "--expert-parallel",
        action="store_true",
        help="DeepSeek-V4 with --tensor-parallel-size N: each rank holds E/N whole routed "
        "experts (instead of 1/N of every expert's intermediate dim); outputs are all-reduced",
    )
    g.add_argument(
        "--ep-dispatch",
        choices=("all-reduce", "all-to-all"),
        default=d.ep_dispatch,
        help="with --expert-parallel: every rank runs its experts over all tokens and one "
        "all-reduce per MoE sums them (all-reduce), or each rank sends the 1/N of the tokens it "
        "owns to their experts' ranks and back, then all-gathers (all-to-all: more bytes while "
        "attention keeps every token on every rank; see README)",
    )
    g.add_argument(
        "--page-size",
        type=int,
        default=c.page_size,
        help="tokens per KV page (DeepSeek-V4: rounded up to a multiple of every compress ratio)",
    )
    g.add_argument(
        "--index-k-dtype",
        choices=INDEX_K_DTYPES,
        default=c.index_k_dtype,
        help="DeepSeek-V4 indexer keys in the cache: auto = the model dtype (bf16 on GPU), "
        "fp8 = e4m3 with a per-row scale (less memory, worse long-context recall)",
    )
    g.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool size in tokens (default: sized from free memory)",
    )
    g.add_argument("--memory-fraction", type=float, default=c.memory_fraction)
    g.add_argument(
        "--disable-prefix-cache",
        action="store_true",
        help="turn off the radix prefix cache (on by default: a prompt that begins with a "
        "cached prefix, in full KV pages, computes only the rest; the PD decode role never "
        "uses it)",
    )
    g.add_argument(
        "--host-cache-gb",
        type=float,
        default=c.host_cache_gb,
        help="GiB of host memory (pinned on CUDA) that keeps prefix-cache pages evicted from the "
        "device, loaded back on a later hit (0: off, evicted pages are dropped; off with "
        "--disable-prefix-cache and with tensor parallel)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=s.max_num_batched_tokens,
        help="per-step token budget; longer prompts are prefilled in chunks",
    )
    g.add_argument("--max-running-requests", type=int, default=s.max_running_requests)
    g.add_argument(
        "--kv-reserve-ratio",
        type=float,
        default=s.kv_reserve_ratio,
        help="fraction of max_tokens reserved in KV at admission (below 1: preemption may occur)",
    )
    g.add_argument(
        "--kv-reserve-max-tokens",
        type=int,
        default=s.kv_reserve_max_tokens,
        help="output tokens reserved in KV at admission at most; beyond, KV grows on demand",
    )
    g.add_argument(
        "--max-decode-slowdown",
        type=float,
        default=s.max_decode_slowdown,
        metavar="R",
        help="while requests decode, a step carries only the prefill tokens that keep it within "
        "R x a decode-only step (both measured from recent steps; at least one page per step): "
        "decode keeps its pace, prefills take more steps. 0: off, the step budget alone",
    )
    add_speculative_args(p)
    g.add_argument(
        "--test-fault-swap-token",
        default=None,
        metavar="P,K",
        help="TEST ONLY: swap a sampled token with probability P when the batch exceeds K",
    )
    g.add_argument(
        "--test-fault-sticky-error",
        type=int,
        default=d.fault_sticky_error_after,
        metavar="N",
        help="TEST ONLY: from the N-th batch step on, every forward fails, as after a sticky "
        "CUDA error (0: off)",
    )
    g.add_argument(
        "--test-step-delay",
        type=float,
        default=d.test_step_delay_s,
        metavar="S",
        help="TEST ONLY: sleep S seconds in every batch step, a slow server (0: off)",
    )
    x = DisaggConfig()
    g = p.add_argument_group("prefill-decode disaggregation")
    g.add_argument(
        "--role",
        default=d.role,
        choices=["single", "prefill", "decode"],
        help="single: whole requests; prefill/decode: one side of a PD pair behind `kvrelay router`",
    )
    g.add_argument(
        "--transfer-backend",
        default=x.transfer_backend,
        choices=["tcp", "cuda_ipc", "nixl"],
        type=_transfer_backend,
        help="KV transfer backend: tcp (anywhere; bytes through the host), cuda_ipc (servers "
        "on one host: prefill writes straight into decode's GPU pages) or nixl (NIXL one-sided "
        "writes into decode's registered pages, host or GPU memory, across hosts; needs "
        "`pip install 'kvrelay[nixl]'`)",
    )
    g.add_argument(
        "--transfer-host", default=x.transfer_host, help="decode: address the KV listener binds"
    )
    g.add_argument(
        "--transfer-port",
        type=int,
        default=x.transfer_port,
        help="decode: KV listener port (0: any)",
    )
    g.add_argument(
        "--no-transfer-checksum",
        action="store_true",
        help="skip the crc32 over every transferred piece (on by default)",
    )
    g.add_argument(
        "--transfer-layers-per-chunk",
        type=int,
        default=x.layers_per_chunk,
        help="layers per transferred KV piece",
    )
    g.add_argument(
        "--transfer-connect-timeout",
        type=float,
        default=x.connect_timeout_s,
        help="seconds to connect and greet a decode peer",
    )
    g.add_argument(
        "--transfer-bootstrap-timeout",
        type=float,
        default=x.bootstrap_timeout_s,
        help="seconds for the reservation handshake (and for decode's final ack)",
    )
    g.add_argument(
        "--transfer-timeout",
        type=float,
        default=x.transfer_timeout_s,
        help="seconds a reserved request may wait for its prefill (queue + compute + transfer)",
    )
    g.add_argument(
        "--transfer-heartbeat-interval",
        type=float,
        default=x.heartbeat_interval_s,
        help="seconds between heartbeats on every PD peer connection",
    )
    g.add_argument(
        "--transfer-heartbeat-timeout",
        type=float,
        default=x.heartbeat_timeout_s,
        help="seconds of silence after which a PD peer is dropped and its transfers fail",
    )
    add_pd_secret_args(g)
    g.add_argument(
        "--test-corrupt-transfer",
        type=float,
        nargs="?",
        const=1.0,
        default=x.test_corrupt_p,
        metavar="P",
        help="TEST ONLY (prefill): corrupt a request's first KV piece after checksumming, "
        "with probability P (1 when no P is given)",
    )
    g.add_argument(
        "--test-delay-transfer",
        type=float,
        default=x.test_delay_transfer_s,
        metavar="SECONDS",
        help="TEST ONLY (prefill): send every KV piece and first token SECONDS late",
    )


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    sp = SpeculativeConfig()
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative-algorithm",
        default=sp.algorithm,
        choices=SPECULATIVE_ALGORITHMS,
        help="ngram: each decoding request drafts the tokens that followed the latest earlier "
        "occurrence of its context's last tokens (prompt lookup) and the model verifies them in "
        "one step (greedy output unchanged token for token; sampling keeps its distribution); "
        "mtp: DeepSeek-V4's multi-token-prediction block drafts from the model's last hidden "
        "streams, chained on its own output for K > 1 drafts (its weights: the checkpoint's, or "
        "--speculative-draft-model-path); none: off",
    )
    g.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        metavar="K",
        help="drafted tokens per request per step at most (they count against the step budget; "
        f"default {sp.num_draft_tokens} for ngram, {MTP_DEFAULT_DRAFTS} for mtp)",
    )
    g.add_argument(
        "--speculative-disable-batch-size",
        type=int,
        default=sp.disable_batch_size,
        metavar="N",
        help="draft only while fewer than N requests decode (0: always); at a large batch a "
        "verify step's extra rows cost more than the tokens they win",
    )
    g.add_argument(
        "--speculative-ngram-min",
        type=int,
        default=sp.ngram_min,
        metavar="N",
        help="ngram: the shortest context suffix looked up",
    )
    g.add_argument(
        "--speculative-ngram-max",
        type=int,
        default=sp.ngram_max,
        metavar="N",
        help="ngram: the longest context suffix looked up (the longest match wins)",
    )
    g.add_argument(
        "--speculative-draft-model-path",
        default=sp.draft_model_path,
        metavar="FILE",
        help="mtp: a safetensors file of the MTP block (model.mtp.* tensors) where the "
        "checkpoint has none",
    )


def add_pd_secret_args(g) -> None:
    g.add_argument(
        "--pd-secret",
        default=None,
        metavar="SECRET",
        help="the secret the PD servers and the router share: transfer peers prove it to each "
        "other, and a server takes PD routing fields only from a request signed with it "
        "(default: KVRELAY_PD_SECRET; a command line is visible to other local users, so "
        "prefer --pd-secret-file or the environment)",
    )
    g.add_argument(
        "--pd-secret-file",
        default=None,
        metavar="PATH",
        help="read the PD secret from this file (surrounding whitespace is dropped)",
    )


def add_http_args(p: argparse.ArgumentParser, max_body_bytes: int, key_note: str = "") -> None:
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health and /metrics "
        f"(default: KVRELAY_API_KEY; unset: no key){key_note}",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=max_body_bytes,
        help="larger request bodies get 413, chunked ones too",
    )


def pd_secret(a: argparse.Namespace) -> str:
    """--pd-secret, else --pd-secret-file, else KVRELAY_PD_SECRET ("" when none is given)."""
    if a.pd_secret is not None and a.pd_secret_file is not None:
        raise SystemExit("give --pd-secret or --pd-secret-file, not both")
    if a.pd_secret_file is not None:
        try:
            secret = Path(a.pd_secret_file).read_text().strip()
        except OSError as e:
            raise SystemExit(f"cannot read --pd-secret-file: {e}") from None
        if not secret:
            raise SystemExit(f"--pd-secret-file {a.pd_secret_file} is empty")
        return secret
    return a.pd_secret if a.pd_secret is not None else env("KVRELAY_PD_SECRET")


def api_key(a: argparse.Namespace) -> str:
    return a.api_key if a.api_key is not None else env("KVRELAY_API_KEY")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    p, k = 0.0, 0
    if a.test_fault_swap_token:
        ps, ks = a.test_fault_swap_token.split(",")
        p, k = float(ps), int(ks)
    return EngineConfig(
        model=a.model,
        load_format=a.load_format,
        tokenizer=a.tokenizer,
        dtype=a.dtype,
        device=a.device,
        attention_backend=a.attention_backend,
        linear_weights=a.linear_weights,
        cuda_graphs=not a.disable_cuda_graphs,
        max_cuda_graph_batch=a.max_cuda_graph_batch,
        step_profile_every=a.step_profile_every,
        max_model_len=a.max_model_len,
        seed=a.seed,
        deterministic=a.deterministic,
        tensor_parallel_size=a.tensor_parallel_size,
        expert_parallel=a.expert_parallel,
        ep_dispatch=a.ep_dispatch,
        cache=CacheConfig(
            page_size=a.page_size,
            max_total_tokens=a.max_total_tokens,
            memory_fraction=a.memory_fraction,
            index_k_dtype=a.index_k_dtype,
            prefix_cache=not a.disable_prefix_cache,
            host_cache_gb=a.host_cache_gb,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=a.max_num_batched_tokens,
            max_running_requests=a.max_running_requests,
            kv_reserve_ratio=a.kv_reserve_ratio,
            kv_reserve_max_tokens=a.kv_reserve_max_tokens,
            max_decode_slowdown=a.max_decode_slowdown,
        ),
        fault_swap_token_p=p,
        fault_swap_token_min_batch=k,
        fault_sticky_error_after=a.test_fault_sticky_error,
        test_step_delay_s=a.test_step_delay,
        role=a.role,
        disagg=DisaggConfig(
            transfer_backend=a.transfer_backend,
            transfer_host=a.transfer_host,
            transfer_port=a.transfer_port,
            checksum=not a.no_transfer_checksum,
            layers_per_chunk=a.transfer_layers_per_chunk,
            connect_timeout_s=a.transfer_connect_timeout,
            bootstrap_timeout_s=a.transfer_bootstrap_timeout,
            transfer_timeout_s=a.transfer_timeout,
            heartbeat_interval_s=a.transfer_heartbeat_interval,
            heartbeat_timeout_s=a.transfer_heartbeat_timeout,
            test_corrupt_p=a.test_corrupt_transfer,
            test_delay_transfer_s=a.test_delay_transfer,
            pd_secret=pd_secret(a),
        ),
        speculative=SpeculativeConfig(
            algorithm=a.speculative_algorithm,
            num_draft_tokens=_draft_tokens(a),
            ngram_min=a.speculative_ngram_min,
            ngram_max=a.speculative_ngram_max,
            draft_model_path=a.speculative_draft_model_path,
            disable_batch_size=a.speculative_disable_batch_size,
        ),
    )


# Idle client connections are kept this long: longer than clients keep theirs (httpx and so the
# openai client: 5 s, uvicorn's default too), so that the client closes first. With equal times a
# client could reuse a connection the server was closing (a ReadError, seen at 128 sessions).
KEEP_ALIVE_S = 65


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from kvrelay.engine.process_setup import setup_logging
    from kvrelay.server.api import create_app

    setup_logging()
    cfg = ServerConfig(
        host=a.host,
        port=a.port,
        served_model_name=a.served_model_name,
        max_body_bytes=a.max_body_bytes,
        generation_config=a.generation_config,
        api_key=api_key(a),
        engine=engine_config(a),
    )

    served = {}

    def ready(state) -> None:
        served["state"] = state
        # A dead engine ends this process (exit 3): a supervisor restarts it (engine_client.py).
        state.client.on_death = lambda: setattr(served["server"], "should_exit", True)
        url = f"http://{a.host}:{a.port}"
        auth = '-H "Authorization: Bearer $KVRELAY_API_KEY" ' if cfg.api_key else ""
        # Greedy: at the model card's temperature 0.2 the embedded 4-bit 135M model still answers
        # this one with "L'Étoile, ..." about half the time (its first-token choice is a near-tie).
        example = (
            f"curl {url}/v1/chat/completions {auth}-H 'Content-Type: application/json' "
            f'-d \'{{"model": "{state.model_name}", "messages": [{{"role": "user", '
            f'"content": "What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}\''
        )
        print(f"kvrelay ready: {url} (model {state.model_name}) | try: {example}", flush=True)

    raise_open_files_limit(4096)  # a connection per client request (router: one per request)
    server = uvicorn.Server(_uvicorn_config(create_app(cfg, on_ready=ready), a))
    served["server"] = server
    server.run()
    state = served.get("state")
    return state.client.exit_code if state is not None else 0


def cmd_router(a: argparse.Namespace) -> int:
    import uvicorn

    from kvrelay.engine.process_setup import setup_logging
    from kvrelay.router.app import create_router_app

    setup_logging()
    cfg = RouterConfig(
        host=a.host,
        port=a.port,
        prefill=tuple(u for u in a.prefill.split(",") if u),
        decode=tuple(u for u in a.decode.split(",") if u),
        max_attempts=a.max_attempts,
        request_timeout_s=a.request_timeout,
        connect_timeout_s=a.connect_timeout,
        max_body_bytes=a.max_body_bytes,
        max_concurrent_requests=a.max_concurrent_requests,
        policy=a.policy,
        api_key=api_key(a),
        pd_secret=pd_secret(a),
    )
    raise_open_files_limit(3 * cfg.max_concurrent_requests + 256)

    def ready() -> None:
        print(
            f"kvrelay router ready: http://{a.host}:{a.port} prefill={a.prefill} decode={a.decode}",
            flush=True,
        )

    uvicorn.Server(_uvicorn_config(create_router_app(cfg, on_ready=ready), a)).run()
    return 0


def _draft_tokens(a: argparse.Namespace) -> int:
    """--speculative-num-draft-tokens, or when not given the algorithm's own default."""
    if a.speculative_num_draft_tokens is not None:
        return a.speculative_num_draft_tokens
    if a.speculative_algorithm == "mtp":
        return MTP_DEFAULT_DRAFTS
    return SpeculativeConfig().num_draft_tokens


def _uvicorn_config(app, a: argparse.Namespace):
    """Server and router alike: keep-alive past the clients' own, and read deadlines for
    headers and bodies (server/http_timeouts.py: a slowloris client is closed)."""
    import uvicorn

    from kvrelay.server.http_timeouts import TimedH11Protocol

    class Protocol(TimedH11Protocol):
        header_timeout_s = float(env("KVRELAY_HTTP_HEADER_TIMEOUT_S"))
        body_timeout_s = float(env("KVRELAY_HTTP_BODY_TIMEOUT_S"))
        max_pending = int(env("KVRELAY_HTTP_MAX_PENDING"))

    return uvicorn.Config(
        app,
        host=a.host,
        port=a.port,
        log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_S,
        http=Protocol,
    )


def _transfer_backend(name: str) -> str:
    """--transfer-backend's value, refused at start when its optional package is missing."""
    problem = DisaggConfig.backend_problem(name)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return name


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; `command` "serve" or "router" (what the launcher and the tests start,
    ~80 times a test run) leaves out the client commands, whose imports cost ~0.15 s of CPU."""
    p = argparse.ArgumentParser(
        prog="kvrelay",
        description="LLM serving engine",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="environment knobs:\n" + env_help(),
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="environment knobs:\n" + env_help(),
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument(
        "--generation-config",
        default=ServerConfig().generation_config,
        metavar="auto|openai|DIR",
        help="sampling defaults (temperature, top_p, top_k, min_p) for what a request leaves "
        "out: auto: the model's generation_config.json (the embedded SmolLM2: its model card's "
        "temperature 0.2, top_p 0.9); openai: the plain OpenAI defaults; DIR: the "
        "generation_config.json in DIR",
    )
    add_http_args(s, ServerConfig().max_body_bytes)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)
    r = sub.add_parser(
        "router",
        help="OpenAI-compatible front of prefill/decode servers (PD disaggregation)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="environment knobs:\n" + env_help(),
    )
    rc = RouterConfig()
    r.add_argument("--host", default=rc.host, help="address the router listens on")
    r.add_argument("--port", type=int, default=rc.port, help="port the router listens on")
    r.add_argument("--prefill", required=True, help="prefill servers: URL[,URL...]")
    r.add_argument("--decode", required=True, help="decode servers: URL[,URL...]")
    r.add_argument(
        "--max-attempts",
        type=int,
        default=rc.max_attempts,
        help="tries per request, each on a fresh pair, while nothing has been streamed",
    )
    r.add_argument(
        "--request-timeout",
        type=float,
        default=rc.request_timeout_s,
        help="seconds a request may take end to end",
    )
    r.add_argument(
        "--connect-timeout",
        type=float,
        default=rc.connect_timeout_s,
        help="seconds to reach a server",
    )
    r.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=rc.max_concurrent_requests,
        help="requests in flight at most (streams until they end); past it a 503 with "
        "Retry-After, counted as outcome=overloaded",
    )
    r.add_argument(
        "--policy",
        default=rc.policy,
        choices=list(POLICIES),
        help="which prefill and decode server a request goes to: cache_aware (where the "
        "longest prefix of its prompt was sent before, unless that tilts the load), "
        "round_robin, least_load (the least loaded: requests in flight from this router or "
        "reported by the server, its queued prompt tokens, a nearly full KV pool)",
    )
    add_http_args(r, rc.max_body_bytes, " (the router sends it to the servers too)")
    add_pd_secret_args(r)
    r.set_defaults(func=cmd_router)
    if command in ("serve", "router"):
        return p
    # Imported here, not atop: a spawned engine process imports this module (its parent's
    # __main__) and needs none of them (httpx, the load generator: ~0.2 s of CPU per engine).
    from kvrelay.bench.cli import add_bench_parser
    from kvrelay.bench.repro import add_repro_parser
    from kvrelay.ops.cli import add_up_parser

    add_bench_parser(sub)
    add_repro_parser(sub)
    add_up_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
