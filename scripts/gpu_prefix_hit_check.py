"""Does a DeepSeek-V4 prefix-cache hit change greedy output on the GPU fast path, alone (no load)?

Two servers of the tiny agent on one GPU: one with the prefix cache, one without. Each of N
repro sessions' first turn (system prompt + task, tools sent) goes twice to the cached server,
one request at a time (the second time its whole prompt is cached), and once to the uncached one.
Prints, per session whose answers differ, the prompt length, the cached tokens and where the
token ids first differ; then a summary. Usage: python3 scripts/gpu_prefix_hit_check.py URL_CACHE
URL_NOCACHE [N]
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import sys

import httpx

from kvrelay.bench.repro import ReproConfig, request_body
from kvrelay.bench.repro_sessions import initial_messages


def ask(c: httpx.Client, url: str, messages: list[dict], cfg: ReproConfig) -> tuple[list, dict]:
    model = c.get(url + "/v1/models").json()["data"][0]["id"]
    body = request_body(messages, cfg) | {"model": model, "max_tokens": 24}
    r = c.post(url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    d = r.json()
    toks = [t["token"] for t in d["choices"][0]["logprobs"]["content"]]
    return toks, d["usage"]


def first_diff(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    cached, uncached = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    cfg = ReproConfig(url=cached)
    sessions = initial_messages(n, cfg.seed, cfg.task_words)
    with httpx.Client(timeout=120) as c1, httpx.Client(timeout=120) as c2:
        with cf.ThreadPoolExecutor(1) as pool:
            truth = pool.map(lambda m: ask(c2, uncached, m, cfg), sessions)
            rows = []
            for i, m in enumerate(sessions):
                cold, u1 = ask(c1, cached, m, cfg)
                warm, u2 = ask(c1, cached, m, cfg)
                rows.append((i, cold, warm, u1, u2))
            truth = list(truth)
    bad = 0
    for (i, cold, warm, u1, u2), (ref, u0) in zip(rows, truth):
        d_cold, d_warm = first_diff(ref, cold), first_diff(ref, warm)
        if d_cold is not None or d_warm is not None:
            bad += 1
            print(json.dumps({
                "session": i, "prompt_tokens": u0["prompt_tokens"],
                "cold_cached": (u1.get("prompt_tokens_details") or {}).get("cached_tokens"),
                "warm_cached": (u2.get("prompt_tokens_details") or {}).get("cached_tokens"),
                "cold_first_diff": d_cold, "warm_first_diff": d_warm,
                "ref": "".join(ref)[:60], "warm": "".join(warm)[:60],
            }))  # fmt: skip
    lens = sorted({u0["prompt_tokens"] for _, u0 in truth})
    print(f"sessions {n}, differing {bad}; prompt lengths {lens[0]}..{lens[-1]}")


if __name__ == "__main__":
    main()
