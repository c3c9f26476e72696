"""PD vs single server on one machine: TTFT and TPOT at several concurrency levels, and what the
transfer checksum costs. Starts the servers itself (real processes, real HTTP) and drives them
with `kvrelay bench`.

Modes: `single` (`kvrelay serve`), `pd` (`kvrelay up`: router + prefill + decode; on one GPU
both servers share it; tcp backend), `pd-ipc` (cuda_ipc backend: prefill writes into decode's
pages), `pd-nixl` (nixl backend, not in the default list: it needs NIXL installed), `-nocrc`
variants without the transfer checksum. The single server stays up while the PD modes run, and
`kvrelay verify` checks each PD stack against it token for token. Per PD mode, from prefill's
metrics: KV bytes sent per transfer and the rate of sending them (bytes / time in the send
phase), beside the GPU's measured copy bandwidth.

    python benchmarks/pd_vs_single.py --out bench-results/pd_vs_single.json
CPU dry run:  python benchmarks/pd_vs_single.py --model smollm2-135m --concurrency 1,2 \
                  --input-len 64 --output-len 8 --prompts-per-level 4 --memory-fraction 0.3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from kvrelay.bench.metrics import parse_prometheus

MODES = ("single", "pd", "pd-nocrc", "pd-ipc", "pd-ipc-nocrc")
BACKENDS = {"pd-ipc": "cuda_ipc", "pd-nixl": "nixl"}  # by mode prefix; tcp otherwise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s")


def start(mode: str, a: argparse.Namespace, log_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    common = [
        "--model", a.model, "--load-format", "dummy",
        "--max-num-batched-tokens", str(a.max_num_batched_tokens),
    ]  # fmt: skip
    per_server = [
        "--memory-fraction",
        str(a.memory_fraction),
        "--dtype",
        a.dtype,
    ]  # `up` passes these on
    if a.tokenizer:
        per_server += ["--tokenizer", a.tokenizer]
    per_server += shlex.split(a.server_args)  # e.g. "--max-decode-slowdown 1.3"
    if mode == "single":
        cmd = ["serve", "--port", str(port), *common, *per_server]
    else:
        extra = per_server + (["--no-transfer-checksum"] if mode.endswith("-nocrc") else [])
        for prefix, backend in BACKENDS.items():
            if mode.startswith(prefix):
                extra += ["--transfer-backend", backend]
        cmd = ["up", "--port", str(port), "--log-dir", os.path.join(log_dir, mode), *common]
        cmd += [f"--server-args={shlex.join(extra)}"]
        for side, gpus in (
            ("prefill", a.prefill_gpus or a.gpus),
            ("decode", a.decode_gpus or a.gpus),
        ):
            if gpus is not None:  # N GPUs on a side: `up` runs it tensor-parallel over N ranks
                cmd += [f"--{side}-gpus", gpus]
    log = open(os.path.join(log_dir, f"{mode}.log"), "w")  # noqa: SIM115 (lives with the process)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrelay.cli", *cmd],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, a.start_timeout)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench(url: str, a: argparse.Namespace, out_dir: str, mode: str, extra=()) -> dict:
    """`kvrelay bench` of the levels in `a` (plus `extra` arguments); its JSON result."""
    name = f"{mode}.json"
    levels = [int(c) for c in a.concurrency.split(",")]
    cmd = [
        sys.executable, "-m", "kvrelay.cli", "bench", "--base-url", url,
        "--dataset-name", "random", "--input-len", str(a.input_len),
        "--output-len", str(a.output_len), "--ignore-eos", "--concurrency", a.concurrency,
        "--num-prompts", str(a.prompts_per_level * max(levels)), "--num-warmups", "2",
        "--result-dir", out_dir, "--result-filename", name, "--no-plots",
        "--disable-progress", "--ledger", "off", *extra,
    ]  # fmt: skip
    subprocess.run(cmd, check=False, timeout=a.bench_timeout)
    with open(os.path.join(out_dir, name)) as f:
        return json.load(f)


def verify(ref: str, url: str, a: argparse.Namespace, out_dir: str, mode: str) -> dict:
    """Greedy, token for token: the PD stack against the single server."""
    name = f"verify-{mode}.json"
    cmd = [
        sys.executable, "-m", "kvrelay.cli", "verify", ref, url,
        "--num-prompts", str(a.verify_prompts), "--input-len", str(a.input_len),
        "--output-len", "64", "--concurrency", "8", "--result-dir", out_dir,
        "--result-filename", name, "--ledger", "off",
    ]  # fmt: skip
    rc = subprocess.run(cmd, check=False, timeout=a.bench_timeout).returncode
    with open(os.path.join(out_dir, name)) as f:
        v = json.load(f)
    return {"exit_code": rc, "summary": v.get("summary", {})}


def transfer_stats(router_url: str) -> dict:
    """What the stack's prefill servers sent (their /metrics, found through the router's
    /server_info): bytes per transfer, and bytes over the time spent in the send phase."""

    def get(url: str) -> str:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.read().decode()

    def total(samples, name: str, **want: str) -> float:
        return sum(v for labels, v in samples.get(name, []) if want.items() <= labels.items())

    sent = seconds = count = 0.0
    for url in json.loads(get(router_url + "/server_info"))["config"]["prefill"]:
        m = parse_prometheus(get(url + "/metrics"))
        sent += total(m, "kvrelay_pd_transfer_bytes_total", direction="sent")
        send = {"side": "prefill", "phase": "send"}
        seconds += total(m, "kvrelay_pd_transfer_seconds_sum", **send)
        count += total(m, "kvrelay_pd_transfer_seconds_count", **send)
    return {
        "bytes_sent": sent,
        "transfers": count,
        "bytes_per_transfer": sent / count if count else None,
        "send_seconds": seconds,
        "send_GBps": sent / seconds / 1e9 if seconds else None,
    }


def row(level: dict) -> dict:
    return {
        "concurrency": level["concurrency"],
        "completed": level["completed"],
        "failed": level["failed"],
        "ttft_ms_mean": level["ttft_ms"]["mean"],
        "ttft_ms_p50": level["ttft_ms"].get("p50"),
        "ttft_ms_p99": level["ttft_ms"].get("p99"),
        "tpot_ms_mean": level["tpot_ms"]["mean"],
        "tpot_ms_p50": level["tpot_ms"].get("p50"),
        "output_tok_s": level["output_throughput"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-level", type=int, default=4, help="x the largest concurrency")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--memory-fraction", type=float, default=0.4, help="per server")
    p.add_argument("--dtype", default="auto", help="bfloat16 on GPU; float32 for exact verify")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir for the servers")
    p.add_argument("--gpus", default=None, help="CUDA_VISIBLE_DEVICES of both PD servers")
    p.add_argument("--prefill-gpus", default=None, help="prefill's GPUs (default --gpus; N: TP=N)")
    p.add_argument("--decode-gpus", default=None, help="decode's GPUs (default --gpus; N: TP=N)")
    p.add_argument("--server-args", default="", help="more arguments for every server (one string)")
    p.add_argument("--verify-prompts", type=int, default=16, help="0: no verify")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--bench-timeout", type=float, default=900)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    # bench's own per-level request count: prompts-per-level x concurrency would be fairer, but
    # bench takes one --num-prompts; levels below the largest see the same number of requests.
    work = tempfile.mkdtemp(prefix="kvrelay-pd-bench-")
    results: dict = {"modes": {}, "meta": meta(a)}
    single = None  # kept up as the reference of every PD mode's verify
    try:
        for mode in a.modes.split(","):
            proc, url = start(mode, a, work)
            try:
                res = bench(url, a, work, mode)
                if mode != "single":
                    results.setdefault("transfer", {})[mode] = transfer_stats(url)
                if mode == "single":
                    single, proc = (proc, url), None
                elif single is not None and a.verify_prompts:
                    results.setdefault("verify", {})[mode] = verify(single[1], url, a, work, mode)
            finally:
                if proc is not None:
                    stop(proc)
            results["modes"][mode] = [row(lv) for lv in res["levels"]]
    finally:
        if single is not None:
            stop(single[0])
    if results.get("transfer"):  # after the servers: this process holds no GPU memory before
        results["meta"]["copy_GBps"] = copy_GBps()
    print_table(results)
    for mode, t in results.get("transfer", {}).items():
        per = t["bytes_per_transfer"] or 0
        print(f"transfer {mode}: {t['transfers']:.0f} sent, {per / 1e6:.1f} MB each, "
              f"{t['send_GBps'] or 0:.2f} GB/s sending (device copy, read + write: "
              f"{results['meta'].get('copy_GBps') or 0:.0f} GB/s)")  # fmt: skip
    for mode, v in results.get("verify", {}).items():
        print(f"verify single vs {mode}: exit {v['exit_code']} {json.dumps(v['summary'])[:300]}")
    print(f"logs and raw bench JSON: {work}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


def copy_GBps() -> float | None:
    """The GPU's device-to-device copy bandwidth (decode_throughput's measurement), if any."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from decode_throughput import copy_bandwidth  # same directory

    return copy_bandwidth() / 1e9


def meta(a: argparse.Namespace) -> dict:
    try:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        device = "unknown"
    return {
        "model": a.model,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "server_args": a.server_args,
        "device": device,
        "date": datetime.date.today().isoformat(),
    }


def print_table(results: dict) -> None:
    print(f"{'mode':<9} {'conc':>4} {'ok':>4} {'fail':>4} {'TTFT mean':>10} {'TTFT p99':>9} "
          f"{'TPOT mean':>10} {'out tok/s':>10}")  # fmt: skip
    for mode, rows in results["modes"].items():
        for r in rows:
            print(
                f"{mode:<9} {r['concurrency']:>4} {r['completed']:>4} {r['failed']:>4} "
                f"{r['ttft_ms_mean']:>10.1f} {r['ttft_ms_p99'] or 0:>9.1f} "
                f"{r['tpot_ms_mean']:>10.2f} {r['output_tok_s']:>10.1f}"
            )


if __name__ == "__main__":
    main()
