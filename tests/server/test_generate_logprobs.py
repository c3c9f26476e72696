"""SGLang's native `/generate` with `return_logprob` (issue 28 item 4): input and output token
logprobs in SGLang's shape ([logprob, token_id, text-or-None]; the prompt's first token None),
top alternatives with `top_logprobs_num`, from `logprob_start_len`; the same numbers the OpenAI
routes give. And sglang.bench_serving's `--backend sglang` requests (recorded from its source:
fixtures/sglang_bench_serving.json) replayed as it sends and reads them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

PROMPT = "1, 2, 3, 4,"
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "sglang_bench_serving.json").read_text())


def _generate(url: str, **body) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_logprobs_in_sglang_shape_match_the_openai_route(server, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(PROMPT)
    params = {"temperature": 0, "max_new_tokens": 4}
    ref = httpx.post(
        server.url + "/v1/completions",
        json={"model": "smollm2", "prompt": ids, "max_tokens": 4, "temperature": 0,
              "echo": True, "logprobs": 2},
        timeout=300,
    ).json()["choices"][0]["logprobs"]  # fmt: skip
    d = _generate(server.url, input_ids=ids, sampling_params=params, return_logprob=True,
                  logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)  # fmt: skip
    m = d["meta_info"]
    inp, out = m["input_token_logprobs"], m["output_token_logprobs"]
    assert [t for _, t, _ in inp] == ids and inp[0][0] is None
    assert [t for _, t, _ in out] == d["output_ids"] and len(out) == 4
    assert [s for _, _, s in inp + out] == ref["tokens"]
    assert [lp for lp, _, _ in inp[1:] + out] == pytest.approx(ref["token_logprobs"][1:], abs=1e-4)
    assert m["input_top_logprobs"][0] is None
    for tops, want in zip(m["input_top_logprobs"][1:] + m["output_top_logprobs"], ref["top_logprobs"][1:], strict=True):  # fmt: skip
        assert len(tops) == 2 and {s: lp for lp, _, s in tops} == pytest.approx(want, abs=1e-4)
    # From position 3 on; text left out (SGLang's default); -1: output tokens only.
    d3 = _generate(server.url, input_ids=ids, sampling_params=params, return_logprob=True,
                   logprob_start_len=3)  # fmt: skip
    assert d3["meta_info"]["input_token_logprobs"] == [[pytest.approx(lp, abs=1e-4), t, None] for lp, t, _ in inp[3:]]  # fmt: skip
    assert "input_top_logprobs" not in d3["meta_info"]
    d_1 = _generate(server.url, input_ids=ids, sampling_params=params, return_logprob=True)
    assert d_1["meta_info"]["input_token_logprobs"] == []
    assert len(d_1["meta_info"]["output_token_logprobs"]) == 4


def run_bench_request(url: str, payload: dict) -> dict:
    """One request as bench_serving's async_request_sglang_generate sends and reads it."""
    text, output_len, prompt_len, events = "", 0, None, 0
    with httpx.stream("POST", url + "/generate", json=payload, timeout=300) as r:
        assert r.status_code == 200, r.read().decode()
        for raw in r.iter_lines():
            raw = raw.strip()
            if not raw:
                continue
            data = raw[6:] if raw.startswith("data: ") else raw
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            prompt_len = (chunk.get("usage") or chunk.get("meta_info") or {}).get("prompt_tokens")
            if chunk.get("text"):
                text, output_len = chunk["text"], chunk["meta_info"]["completion_tokens"]
                events += 1
                last = chunk
    return {"text": text, "output_len": output_len, "prompt_len": prompt_len, "last": last,
            "events": events}  # fmt: skip


def replay_bench(url: str) -> list[dict]:
    """bench_serving's session: GET /v1/models (ready check, model id), the warm-up, the
    benchmark requests, one with --return-logprob, GET /server_info."""
    models = httpx.get(url + "/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "smollm2"
    results = []
    for payload in [FIXTURE["warmup"], *FIXTURE["benchmark"], FIXTURE["with_logprobs"]]:
        res = run_bench_request(url, payload)
        assert res["output_len"] == payload["sampling_params"]["max_new_tokens"]  # ignore_eos
        assert res["text"] and res["prompt_len"] > 0 and res["events"] >= 1
        results.append(res)
    info = httpx.get(url + "/server_info", timeout=30)
    assert info.status_code in (200, 404)  # read only when 200
    return results


def test_sglang_bench_serving_requests_run_unmodified(server):
    results = replay_bench(server.url)  # was a 400: return_logprob, return_routed_experts
    meta = results[-1]["last"]["meta_info"]
    n_in = meta["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == n_in and len(meta["input_top_logprobs"]) == n_in
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
