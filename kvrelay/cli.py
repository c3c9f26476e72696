"""The one command line: `kvrelay serve` (more subcommands join as they land)."""

from __future__ import annotations

import argparse
import sys

from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig, env_help


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d, c, s = EngineConfig(), CacheConfig(), SchedulerConfig()
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=d.model,
                   help="'smollm2' (embedded SmolLM2-135M-Instruct), a .gguf file, an HF directory, or a dummy preset")
    g.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"],
                   help="'dummy': random weights for a preset (llama-1b, smollm2-135m, qwen3-tiny)")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    g.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", "torch", "triton"])
    g.add_argument("--disable-cuda-graphs", action="store_true", help="run decode eagerly on GPU")
    g.add_argument("--max-cuda-graph-batch", type=int, default=d.max_cuda_graph_batch)
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--page-size", type=int, default=c.page_size, help="tokens per KV page")
    g.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool size in tokens (default: sized from free memory)")
    g.add_argument("--memory-fraction", type=float, default=c.memory_fraction)
    g.add_argument("--max-num-batched-tokens", type=int, default=s.max_num_batched_tokens,
                   help="per-step token budget; longer prompts are prefilled in chunks")
    g.add_argument("--max-running-requests", type=int, default=s.max_running_requests)
    g.add_argument("--kv-reserve-ratio", type=float, default=s.kv_reserve_ratio,
                   help="fraction of max_tokens reserved in KV at admission (below 1: preemption may occur)")
    g.add_argument("--test-fault-swap-token", default=None, metavar="P,K",
                   help="TEST ONLY: swap a sampled token with probability P when the batch exceeds K")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    p, k = 0.0, 0
    if a.test_fault_swap_token:
        ps, ks = a.test_fault_swap_token.split(",")
        p, k = float(ps), int(ks)
    return EngineConfig(
        model=a.model, load_format=a.load_format, dtype=a.dtype, device=a.device,
        attention_backend=a.attention_backend, cuda_graphs=not a.disable_cuda_graphs,
        max_cuda_graph_batch=a.max_cuda_graph_batch, max_model_len=a.max_model_len, seed=a.seed,
        cache=CacheConfig(page_size=a.page_size, max_total_tokens=a.max_total_tokens,
                          memory_fraction=a.memory_fraction),
        scheduler=SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens,
                                  max_running_requests=a.max_running_requests,
                                  kv_reserve_ratio=a.kv_reserve_ratio),
        fault_swap_token_p=p, fault_swap_token_min_batch=k,
    )


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from kvrelay.engine.process import setup_logging
    from kvrelay.server.api import create_app

    setup_logging()
    cfg = ServerConfig(host=a.host, port=a.port, served_model_name=a.served_model_name, max_n=1,
                       engine=engine_config(a))

    def ready(state) -> None:
        url = f"http://{a.host}:{a.port}"
        example = (f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
                   f"-d '{{\"model\": \"{state.model_name}\", \"messages\": [{{\"role\": \"user\", "
                   f"\"content\": \"Hello!\"}}], \"max_tokens\": 32}}'")
        print(f"kvrelay ready: {url} (model {state.model_name}) | try: {example}", flush=True)

    uvicorn.run(create_app(cfg, on_ready=ready), host=a.host, port=a.port, log_level="warning")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrelay", description="LLM serving engine",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="environment knobs:\n" + env_help())
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="environment knobs:\n" + env_help())
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
