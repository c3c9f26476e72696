"""`--deterministic` across prefill–decode disaggregation, in bf16 (the dtype where batch shape
changes bits): every request through a PD stack (prefill chunks of 64 tokens beside other
requests, the first token sampled on prefill, the rest on decode in batches of 4) gives the very
text and logprobs a single server gives it alone, sampled with a seed and greedy. Without the
mode this fails here (measured: most requests differ in their logprobs)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from pd_stack import PDStack

MODEL = ("--model", "smollm2", "--dtype", "bfloat16", "--deterministic")
SINGLE = (*MODEL, "--max-total-tokens", "4096", "--max-num-batched-tokens", "16")
STORY = "The keeper climbed the stairs each evening and wrote the weather in his notebook. "
PROMPTS = [
    "The capital of France is",
    STORY * 4 + "The next morning",  # ~70 tokens: two prefill chunks
    "1, 2, 3, 4,",
    STORY * 2 + "Then",
]


@pytest.fixture(scope="module")
def pd():
    stack = PDStack(model=MODEL, max_total_tokens=4096)
    yield stack
    stack.close()


def ask(url: str, i: int) -> tuple[str, list[float]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(
        model="smollm2", prompt=PROMPTS[i], max_tokens=5, temperature=float(i % 2 == 0),
        seed=40 + i, logprobs=1,
    )  # fmt: skip
    return r.choices[0].text, r.choices[0].logprobs.token_logprobs


def test_pd_at_concurrency_4_equals_single_alone_bitwise(pd, shared_servers) -> None:
    single = shared_servers.get({"det": SINGLE})["det"]
    alone = [ask(single.url, i) for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        through_pd = list(ex.map(lambda i: ask(pd.router.url, i), range(len(PROMPTS))))
    for i, (want, got) in enumerate(zip(alone, through_pd, strict=True)):
        assert got == want, f"prompt {i}: PD {got} vs single alone {want}"
    pd.wait_idle()


def test_repro_deterministic_check_through_the_router(pd, tmp_path) -> None:
    """`kvrelay repro --deterministic-check` reads each server's mode through the router's
    /server_info and replays with no near-tie allowance: 0 divergent turns."""
    import argparse
    import json

    import httpx

    from kvrelay.bench.repro import add_repro_parser

    def repro(*args: str) -> int:
        p = argparse.ArgumentParser(prog="kvrelay")
        add_repro_parser(p.add_subparsers(dest="command", required=True))
        a = p.parse_args(["repro", *args])
        return a.func(a)

    info = httpx.get(pd.router.url + "/server_info", timeout=30).json()
    assert info["role"] == "router" and set(info["servers"]) == {pd.prefill.url, pd.decode.url}
    assert info["config"]["pd_secret"] == "<set>"  # redacted
    out = tmp_path / "repro.json"
    rc = repro(
        f"--base-url={pd.router.url}", "--deterministic-check", "--concurrency", "2",
        *"--num-sessions 2 --turns 1 --max-tokens 3 --task-words 0 --system-prompt=Agent.".split(),
        *"--no-tools-field --ledger off --output-json".split(), str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert rc == 0, result["examples"]
    assert result["deterministic_servers"] == sorted([pd.prefill.url, pd.decode.url])
    (level,) = result["levels"]
    assert level["compared"] == 2 and level["divergent_turns"] == 0
