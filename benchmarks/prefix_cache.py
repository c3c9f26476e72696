"""Prefix cache on vs off: the same multi-turn shared-prefix workload (`kvrelay bench
--dataset-name shared-prefix-chat`, greedy, so both servers see the very same conversations)
against `kvrelay serve` with and without `--disable-prefix-cache`. Reports TTFT, the prompt tokens
prefilled vs found in the cache (from each response's usage.prompt_tokens_details.cached_tokens)
and the server's prefix-cache counters. Starts the servers itself, one after the other.

CPU (SmolLM2, a couple of minutes):
    python benchmarks/prefix_cache.py --out benchmarks/results/prefix_cache_smollm2_cpu.json
CPU (the tiny DeepSeek-V4 agent, under a minute):
    python benchmarks/prefix_cache.py --model ../shared/models/dsv4-tiny-agent --num-prompts 12 \
        --prefix-len 384 --max-total-tokens 8192 \
        --out benchmarks/results/prefix_cache_dsv4_tiny_agent_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

from pd_vs_single import free_port, stop, wait_healthy


def start(a: argparse.Namespace, cache: bool, log_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "kvrelay.cli", "serve", "--port", str(port), "--model", a.model,
        "--dtype", a.dtype, "--max-num-batched-tokens", str(a.max_num_batched_tokens),
        "--max-total-tokens", str(a.max_total_tokens),
    ]  # fmt: skip
    if a.load_format:
        cmd += ["--load-format", a.load_format]
    if not cache:
        cmd.append("--disable-prefix-cache")
    log = open(os.path.join(log_dir, f"cache-{'on' if cache else 'off'}.log"), "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, a.start_timeout)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def bench(url: str, a: argparse.Namespace, out_dir: str, name: str) -> dict:
    cmd = [
        sys.executable, "-m", "kvrelay.cli", "bench", "--base-url", url,
        "--dataset-name", "shared-prefix-chat", "--prefix-len", str(a.prefix_len),
        "--num-prefix-groups", str(a.num_prefix_groups), "--num-turns", str(a.num_turns),
        "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--ignore-eos",
        "--concurrency", a.concurrency, "--num-prompts", str(a.num_prompts),
        "--num-warmups", "0", "--seed", str(a.seed), "--result-dir", out_dir,
        "--result-filename", name, "--no-plots", "--disable-progress", "--ledger", "off",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=a.bench_timeout)
    with open(os.path.join(out_dir, name)) as f:
        return json.load(f)


def row(level: dict) -> dict:
    t, s = level["ttft_ms"], level.get("server") or {}
    return {
        "concurrency": level["concurrency"],
        "completed": level["completed"],
        "failed": level["failed"],
        "prompt_tokens": level["total_input_tokens"],
        "cached_tokens": level["total_cached_tokens"],
        "prefill_tokens_computed": level["prefill_tokens_computed"],
        "ttft_ms_mean": t["mean"],
        "ttft_ms_p50": t.get("p50"),
        "ttft_ms_p90": t.get("p90"),
        "e2el_ms_mean": level["e2el_ms"]["mean"],
        "output_tok_s": level["output_throughput"],
        "server_prefix_hit_tokens": s.get("prefix_cache_hit_tokens"),
        "server_prefix_query_tokens": s.get("prefix_cache_query_tokens"),
        "server_prefix_evicted_pages": s.get("prefix_cache_evicted_pages"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--load-format", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per level")
    p.add_argument("--prefix-len", type=int, default=512, help="shared system prompt tokens")
    p.add_argument("--num-prefix-groups", type=int, default=2)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--input-len", type=int, default=32, help="tokens per user turn")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--bench-timeout", type=float, default=900)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="kvrelay-prefix-bench-")
    results: dict = {"meta": meta(a), "modes": {}}
    for mode in ("off", "on"):
        proc, url = start(a, mode == "on", work)
        try:
            res = bench(url, a, work, f"cache-{mode}.json")
        finally:
            stop(proc)
        results["modes"][mode] = [row(lv) for lv in res["levels"]]
    print_table(results)
    print(f"logs and raw bench JSON: {work}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


def print_table(results: dict) -> None:
    print(
        f"{'cache':<6}{'conc':>5}{'prompt tok':>11}{'cached':>8}{'prefilled':>10}"
        f"{'TTFT mean':>11}{'TTFT p50':>10}{'TTFT p90':>10}{'e2e mean':>10}"
    )
    for mode, rows in results["modes"].items():
        for r in rows:
            print(
                f"{mode:<6}{r['concurrency']:>5}{r['prompt_tokens']:>11}{r['cached_tokens']:>8}"
                f"{r['prefill_tokens_computed']:>10}{r['ttft_ms_mean']:>9.0f}ms"
                f"{r['ttft_ms_p50']:>8.0f}ms{r['ttft_ms_p90']:>8.0f}ms{r['e2el_ms_mean']:>8.0f}ms"
            )


def meta(a: argparse.Namespace) -> dict:
    import torch

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": vars(a),
    }


if __name__ == "__main__":
    main()
