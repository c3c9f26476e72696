"""`kvrelay up`: the command line of the launcher (router + prefill and decode servers, one of each
or N and M replicas, on one machine)."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys


def add_up_parser(subparsers) -> argparse.ArgumentParser:
    u = subparsers.add_parser(
        "up",
        help="start router + prefill + decode servers (--prefill-replicas/--decode-replicas) on "
        "this machine; supervise; Ctrl-C stops, SIGHUP co-restarts",
    )
    u.add_argument("--host", default="127.0.0.1", help="address the router listens on")
    u.add_argument("--port", type=int, default=8000, help="router port (0: any free port)")
    u.add_argument("--server-host", default="127.0.0.1", help="address prefill/decode listen on")
    u.add_argument(
        "--prefill-port",
        type=int,
        default=0,
        help="prefill HTTP port; replica i: this + i (0: any free ports)",
    )
    u.add_argument(
        "--decode-port",
        type=int,
        default=0,
        help="decode HTTP port; replica i: this + i (0: any free ports)",
    )
    u.add_argument(
        "--transfer-port",
        type=int,
        default=0,
        help="decode KV listener port; replica i: this + i (0: any free ports)",
    )
    u.add_argument(
        "--prefill-replicas",
        type=int,
        default=1,
        help="prefill servers (each its ports, log, GPUs)",
    )
    u.add_argument(
        "--decode-replicas", type=int, default=1, help="decode servers (each its ports, log, GPUs)"
    )
    u.add_argument("--log-dir", default="kvrelay-logs", help="one log file per process goes here")
    u.add_argument(
        "--prefill-gpus",
        default=None,
        help="CUDA_VISIBLE_DEVICES of the prefill replicas: a list (0-3) split evenly among them "
        "in order (2 replicas: 0,1 and 2,3), or one group per replica separated by '/' (0,1/2); "
        "a replica's N GPUs are its TP=N ranks",
    )
    u.add_argument(
        "--decode-gpus",
        default=None,
        help="CUDA_VISIBLE_DEVICES of the decode replicas, as --prefill-gpus (e.g. 4,5)",
    )
    u.add_argument("--model", default=None, help="passed to every server (see `kvrelay serve`)")
    u.add_argument("--load-format", default=None, choices=["auto", "dummy"])
    u.add_argument("--max-total-tokens", type=int, default=None)
    u.add_argument("--max-num-batched-tokens", type=int, default=None)
    u.add_argument(
        "--disable-prefix-cache",
        action="store_true",
        help="passed to every server: no radix prefix cache (prefill uses one by default)",
    )
    u.add_argument(
        "--deterministic",
        action="store_true",
        help="passed to every server: batch-invariant mode (see `kvrelay serve --help`)",
    )
    u.add_argument(
        "--server-args",
        default="",
        help="more `kvrelay serve` args for every server, e.g. --server-args='--dtype float32'",
    )
    u.add_argument(
        "--prefill-args", default="", help="more `kvrelay serve` args for every prefill server"
    )
    u.add_argument(
        "--decode-args", default="", help="more `kvrelay serve` args for every decode server"
    )
    u.add_argument("--router-args", default="", help="more `kvrelay router` args")
    u.add_argument(
        "--api-key",
        default=None,
        help="API key of the stack: the router asks clients for it (`Authorization: Bearer "
        "KEY`), the servers ask the router (default: KVRELAY_API_KEY; unset: no key)",
    )
    u.add_argument(
        "--health-timeout",
        type=float,
        default=600.0,
        help="seconds each stage may take to become healthy",
    )
    u.set_defaults(func=cmd_up)
    return u


def launch_config(a: argparse.Namespace):
    """The stack's LaunchConfig; ValueError (with the reason) for one that cannot be laid out:
    GPUs that do not split among the replicas, two children on one port."""
    import secrets

    from kvrelay.config import env
    from kvrelay.ops.stack import LaunchConfig, validate

    common: list[str] = []
    for flag, val in (
        ("--model", a.model),
        ("--load-format", a.load_format),
        ("--max-total-tokens", a.max_total_tokens),
        ("--max-num-batched-tokens", a.max_num_batched_tokens),
    ):
        if val is not None:
            common += [flag, str(val)]
    if a.disable_prefix_cache:
        common.append("--disable-prefix-cache")
    if a.deterministic:
        common.append("--deterministic")
    cfg = LaunchConfig(
        host=a.host,
        port=a.port,
        server_host=a.server_host,
        prefill_port=a.prefill_port,
        decode_port=a.decode_port,
        transfer_port=a.transfer_port,
        prefill_replicas=a.prefill_replicas,
        decode_replicas=a.decode_replicas,
        log_dir=a.log_dir,
        prefill_gpus=a.prefill_gpus,
        decode_gpus=a.decode_gpus,
        server_args=(*common, *shlex.split(a.server_args)),
        prefill_args=tuple(shlex.split(a.prefill_args)),
        decode_args=tuple(shlex.split(a.decode_args)),
        router_args=tuple(shlex.split(a.router_args)),
        health_timeout_s=a.health_timeout,
        api_key=a.api_key if a.api_key is not None else env("KVRELAY_API_KEY"),
        # This stack's own (its children get it, no one else), unless KVRELAY_PD_SECRET names
        # one (servers on another host, or a harness that signs as the router would).
        pd_secret=env("KVRELAY_PD_SECRET") or secrets.token_urlsafe(32),
    )
    validate(cfg)
    return cfg


def cmd_up(a: argparse.Namespace) -> int:
    from kvrelay.config import env
    from kvrelay.ops.launcher import Launcher

    logging.basicConfig(
        level=env("KVRELAY_LOG_LEVEL"),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # health polls are not events

    try:
        cfg = launch_config(a)
    except ValueError as e:
        print(f"kvrelay up: error: {e}", file=sys.stderr)
        return 2

    def ready(url: str, model: str) -> None:
        auth = '-H "Authorization: Bearer $KVRELAY_API_KEY" ' if cfg.api_key else ""
        # Greedy: at the model card's temperature 0.2 the embedded 4-bit 135M model still answers
        # this one with "L'Étoile, ..." about half the time (its first-token choice is a near-tie).
        example = (
            f"curl {url}/v1/chat/completions {auth}-H 'Content-Type: application/json' "
            f'-d \'{{"model": "{model}", "messages": [{{"role": "user", '
            f'"content": "What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}\''
        )
        print(f"kvrelay up ready: {url} (model {model}) | try: {example}", flush=True)

    return Launcher(cfg, on_ready=ready).run()


def main(argv: list[str] | None = None) -> int:
    """A parser with just `up` (usable before `kvrelay up` is wired into kvrelay.cli)."""
    p = argparse.ArgumentParser(prog="kvrelay")
    add_up_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
