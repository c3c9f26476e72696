"""Routing policies over N prefill x M decode servers (`kvrelay router --policy`): the same kind
of multi-turn shared-prefix workload (`kvrelay bench --dataset-name shared-prefix-chat`) through
a router of each policy in front of the same servers, each policy with its own seed (its own
system prompts and conversations, so no policy finds what another left in the caches). Reports
the prompt tokens found cached (usage.cached_tokens), TTFT and throughput per policy, and what
the router believed cached (kvrelay_router_matched_blocks_total / prompt_blocks_total).

CPU (SmolLM2, 2 prefill x 2 decode, a few minutes):
    python benchmarks/routing_policy.py --out benchmarks/results/routing_policy_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import httpx
from pd_vs_single import free_port, stop, wait_healthy
from prefix_cache import bench, row
from prefix_cache import meta as prefix_meta

SECRET = "routing-policy-bench-secret"


def start(args: list[str], name: str, log_dir: str, timeout: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(os.path.join(log_dir, f"{name}.log"), "w")  # noqa: SIM115 (lives with the process)
    env = dict(os.environ, KVRELAY_CPU_THREADS=os.environ.get("KVRELAY_CPU_THREADS", "1"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrelay.cli", *args, "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def router_blocks(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for name in ("prompt_blocks", "matched_blocks"):
        for role, v in re.findall(rf'kvrelay_router_{name}_total{{role="(\w+)"}} (\S+)', text):
            out[f"{role}_{name}"] = float(v)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--load-format", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefill-servers", type=int, default=2)
    p.add_argument("--decode-servers", type=int, default=2)
    p.add_argument("--policies", default="round_robin,least_load,cache_aware")
    p.add_argument("--concurrency", default="16")
    p.add_argument("--num-prompts", type=int, default=48, help="requests per policy")
    p.add_argument("--prefix-len", type=int, default=256, help="shared system prompt tokens")
    p.add_argument("--num-prefix-groups", type=int, default=4)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--input-len", type=int, default=32, help="tokens per user turn")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--bench-timeout", type=float, default=1200)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="kvrelay-routing-bench-")
    common = [
        "serve", "--model", a.model, "--dtype", a.dtype, "--pd-secret", SECRET,
        "--max-num-batched-tokens", str(a.max_num_batched_tokens),
        "--max-total-tokens", str(a.max_total_tokens),
    ]  # fmt: skip
    if a.load_format:
        common += ["--load-format", a.load_format]
    procs, urls = [], {"prefill": [], "decode": []}
    results: dict = {"meta": meta(a), "policies": {}}
    try:
        for role, n in (("prefill", a.prefill_servers), ("decode", a.decode_servers)):
            for i in range(n):
                proc, url = start([*common, "--role", role], f"{role}{i}", work, a.start_timeout)
                procs.append(proc)
                urls[role].append(url)
        for k, policy in enumerate(a.policies.split(",")):
            rargs = [
                "router", "--prefill", ",".join(urls["prefill"]),
                "--decode", ",".join(urls["decode"]), "--pd-secret", SECRET, "--policy", policy,
            ]  # fmt: skip
            rproc, rurl = start(rargs, f"router-{policy}", work, 60)
            try:
                b = argparse.Namespace(**{**vars(a), "seed": a.seed + 1000 * k})
                res = bench(rurl, b, work, f"{policy}.json")
                blocks = router_blocks(rurl)
            finally:
                stop(rproc)
            results["policies"][policy] = {
                "levels": [row(lv) for lv in res["levels"]],
                "router": blocks,
            }
    finally:
        for proc in procs:
            stop(proc)
    print_table(results)
    print(f"logs and raw bench JSON: {work}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


def print_table(results: dict) -> None:
    print(
        f"{'policy':<12}{'conc':>5}{'ok':>4}{'fail':>5}{'prompt tok':>11}{'cached':>8}{'share':>7}"
        f"{'TTFT mean':>11}{'TTFT p90':>10}{'out tok/s':>10}"
    )
    for policy, res in results["policies"].items():
        for r in res["levels"]:
            share = r["cached_tokens"] / max(r["prompt_tokens"], 1)
            print(
                f"{policy:<12}{r['concurrency']:>5}{r['completed']:>4}{r['failed']:>5}"
                f"{r['prompt_tokens']:>11}{r['cached_tokens']:>8}{share:>7.2f}"
                f"{r['ttft_ms_mean']:>9.0f}ms{r['ttft_ms_p90']:>8.0f}ms{r['output_tok_s']:>10.1f}"
            )


def meta(a: argparse.Namespace) -> dict:
    """prefix_cache.py's run description, and the commit."""
    git = ["git", "rev-parse", "--short", "HEAD"]
    return {
        **prefix_meta(a),
        "commit": subprocess.run(git, capture_output=True, text=True).stdout.strip(),
    }


if __name__ == "__main__":
    main()
