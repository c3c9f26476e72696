"""PD == single server, token for token: prefill + decode + router vs the shared single `server`.

Greedy decoding on CPU (fp32) is exactly reproducible, so every request sent through the router
(streaming and not, chat and completions, prompts shorter and longer than prefill's chunk) must
give the very tokens the single server gives, with the same logprobs; afterwards no KV page and no
request is left on either side.
"""

from __future__ import annotations

import json
import secrets
import socket
import time

import httpx
import openai
import pytest
from conversations import token_bytes, two_turns
from fake_peer import FakePeer
from openai_calls import assert_same_outputs, client, run_specs
from pd_stack import PDStack, bootstrap_events, metrics

from kvrelay.disagg import handshake as H
from kvrelay.disagg import protocol as P

MODEL = "smollm2"
STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
    "listening to the sea, and writing the weather into a leather notebook. "
)


@pytest.fixture(scope="module")
def pd():
    stack = PDStack()
    yield stack
    stack.close()


def _specs() -> list[dict]:
    specs = []
    prompts = [
        "The capital of France is",
        "1, 2, 3, 4,",
        "Write a list of fruits:",
        STORY * 3,  # ~100 tokens: two prefill chunks
        STORY * 6,  # ~200 tokens: longer than prefill's 64-token chunk
        STORY * 9,  # ~300 tokens: several chunks
    ]
    for i, p in enumerate(prompts):
        specs.append(
            {
                "kind": "completion",
                "prompt": p,
                "stream": i % 2 == 1,
                "max_tokens": 12 + 2 * i,
                "logprobs": 2 if i % 3 == 0 else None,
            }
        )
    chats = [
        "Name three colours of the rainbow.",
        "What is 2+2? Answer briefly.",
        STORY * 2 + "Summarise the story.",
        STORY * 6 + "What did the keeper write?",
    ]
    for i, c in enumerate(chats):
        specs.append(
            {
                "kind": "chat",
                "content": c,
                "stream": i % 2 == 0,
                "max_tokens": 16 + 4 * i,
                "logprobs": i % 2 == 1,
            }
        )
    return specs


def test_pd_matches_single_server_token_for_token(pd, server):
    specs = _specs()
    before = {side: metrics(getattr(pd, side).url) for side in ("prefill", "decode")}
    want = run_specs(server.url, MODEL, specs)
    got = run_specs(pd.router.url, MODEL, specs)
    assert_same_outputs(specs, want, got, abs=1e-3)
    pd.wait_idle()
    assert pd.router.metric("kvrelay_router_requests_total", '{outcome="error"}') == 0
    # A stream's outcome is counted when the router's relay closes, a moment after the client
    # read its last event: wait for it.
    deadline = time.time() + 10
    while pd.router.metric("kvrelay_router_requests_total", '{outcome="ok"}') < len(specs):
        assert time.time() < deadline, "the router never counted every request"
        time.sleep(0.1)
    assert pd.router.metric("kvrelay_router_requests_total", '{outcome="ok"}') == len(specs)
    _check_transfer_metrics(pd, before, len(specs), sum(g["prompt_n"] for g in got))


def _check_transfer_metrics(pd, before: dict, transfers: int, prompt_tokens: int) -> None:
    """Both sides moved exactly the KV of the prompts' tokens that decode did not find in its
    own prefix cache (every layer's K and V rows, fp32 on CPU), timed each transfer once, and
    saw the peer connect."""
    hits = "kvrelay_prefix_cache_hit_tokens_total"
    reused = metrics(pd.decode.url).get(hits, 0) - before["decode"].get(hits, 0)
    want = (prompt_tokens - reused) * token_bytes()
    moved = {"prefill": "sent", "decode": "installed"}
    for side, direction in moved.items():
        m, b = metrics(getattr(pd, side).url), before[side]
        key = f'kvrelay_pd_transfer_bytes_total{{backend="tcp",direction="{direction}"}}'
        assert m[key] - b.get(key, 0) == want > 0, side
        for phase in ("transfer", "send") if side == "prefill" else ("transfer", "install"):
            key = f'kvrelay_pd_transfer_seconds_count{{phase="{phase}",side="{side}"}}'
            assert m[key] - b.get(key, 0) == transfers, (side, phase)
        events = bootstrap_events(getattr(pd, side).url)
        assert events.get("peer_connected", 0) >= 1, (side, events)
        assert not events.get("layout_mismatch") and not events.get("peer_lost"), (side, events)


def test_sglang_generate_through_the_router(pd, server):
    """SGLang's /generate is disaggregated too: the same tokens as the single server's, plain
    and streamed, with the request id the router gave it."""
    body = {"text": STORY * 3, "sampling_params": {"temperature": 0, "max_new_tokens": 10}}
    want = httpx.post(server.url + "/generate", json=body, timeout=120).json()
    got = httpx.post(pd.router.url + "/generate", json=body, timeout=120).json()
    assert got["output_ids"] == want["output_ids"] and len(want["output_ids"]) == 10
    assert got["text"] == want["text"] and got["meta_info"]["id"].startswith("cmpl-")
    with httpx.stream(
        "POST", pd.router.url + "/generate", json={**body, "stream": True}, timeout=120
    ) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert events[-1]["output_ids"] == want["output_ids"]
    pd.wait_idle()


def test_prefill_prefix_cache_hit_matches_single_server(pd, server):
    """A prompt sent twice through PD: the second time both sides reuse their cached prefix
    (reported in the usage decode answers with), and the tokens equal the single server's."""
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": STORY * 5 + "Who climbed the stairs?"}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
    )
    want = client(server.url).chat.completions.create(**kw)
    got = [client(pd.router.url).chat.completions.create(**kw) for _ in range(2)]
    hit = got[1].usage.prompt_tokens_details.cached_tokens
    assert hit >= got[1].usage.prompt_tokens - 32 and hit % 16 == 0, hit
    for g in got:
        assert g.choices[0].message.content == want.choices[0].message.content
        assert [x.logprob for x in g.choices[0].logprobs.content] == pytest.approx(
            [x.logprob for x in want.choices[0].logprobs.content], abs=1e-3
        )
    pd.wait_idle()


@pytest.mark.parametrize("n", [1, 8])
def test_second_turn_sends_decode_only_what_it_does_not_hold(pd, server, n):
    """Two-turn conversations (n at once): == the single server token for token; turn 2's
    prompt begins with turn 1's, whose full pages decode cached, so prefill sends only the
    rest: exactly the bytes of the tokens decode did not find, and its usage says so."""
    first, got, moved = two_turns(pd, server.url, n)
    prompt = sum(g["prompt_n"] for g in got)
    held = sum(f["prompt_n"] // 16 * 16 for f in first)  # turn 1's full prompt pages at least
    assert held <= moved["hits"] < prompt and moved["hits"] % 16 == 0, moved
    assert moved["bytes"] == (prompt - moved["hits"]) * token_bytes()
    for f, g in zip(first, got, strict=True):
        assert g["cached"] >= f["prompt_n"] // 16 * 16


def test_first_token_finishes_the_request(pd, server):
    """max_tokens=1: decode gets the first token from prefill and has nothing left to compute."""
    kw = dict(
        model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0, logprobs=1
    )
    w = client(server.url).completions.create(**kw)
    g = client(pd.router.url).completions.create(**kw)
    assert g.choices[0].text == w.choices[0].text and g.choices[0].finish_reason == "length"
    assert g.choices[0].logprobs.token_logprobs == pytest.approx(
        w.choices[0].logprobs.token_logprobs, abs=1e-3
    )
    pd.wait_idle()


def test_bad_request_is_a_400_through_the_router(pd):
    c = client(pd.router.url)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="hi", max_tokens=2)
    pd.wait_idle()


def test_pd_fields_are_taken_only_with_the_routers_signature(pd):
    """A client that names a decode address itself gets 403 from either server, and nothing
    connects to that address."""
    with socket.create_server(("127.0.0.1", 0)) as trap:
        trap.settimeout(1.0)
        fields = {"transfer_id": "t-forged", "request_id": "cmpl-forged"}
        for srv, role in ((pd.prefill, "prefill"), (pd.decode, "decode")):
            pdf = {"role": role, **fields, "decode_addr": f"127.0.0.1:{trap.getsockname()[1]}"}
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "kvrelay_pd": pdf}
            data = json.dumps(body).encode()
            for token in (None, "0" * 64, H.request_token("not-the-secret", data)):
                headers = {"Content-Type": "application/json"}
                if token is not None:
                    headers[H.PD_AUTH_HEADER] = token
                r = httpx.post(srv.url + "/v1/completions", content=data, headers=headers)
                assert r.status_code == 403, r.text
                assert r.json()["error"]["code"] == "pd_auth_failed"
        with pytest.raises(TimeoutError):
            trap.accept()
    pd.wait_idle()


def test_an_unauthenticated_transfer_peer_is_refused(pd):
    """A peer at decode's transfer port without the secret: refused with the cause named to it,
    counted, and logged by decode."""
    info = httpx.get(pd.decode.url + "/pd/info").json()
    before = bootstrap_events(pd.decode.url).get("peer_unauthenticated", 0)
    peer = FakePeer.connect(info["transfer_addr"])
    peer.send(P.Hello("intruder", "prefill", info["layout"], H.new_nonce()))
    assert isinstance(peer.recv(), P.Hello)
    peer.send(P.Auth(secrets.token_bytes(32)))
    refusal = peer.recv()
    assert isinstance(refusal, P.Failure) and refusal.cause == P.Cause.UNAUTHENTICATED
    assert peer.hung_up()
    deadline = time.time() + 10  # the engine ships its counters to the API a moment later
    while bootstrap_events(pd.decode.url).get("peer_unauthenticated", 0) < before + 1:
        assert time.time() < deadline, bootstrap_events(pd.decode.url)
        time.sleep(0.1)
    assert bootstrap_events(pd.decode.url)["peer_unauthenticated"] == before + 1
    assert (
        "transfer peer refused" in pd.decode.log()
        and "cause=peer_unauthenticated" in pd.decode.log()
    )


# ---------------------------------------------------------------- issue 28: the full surface


def _both(pd, server, path: str, body: dict) -> tuple[dict, dict]:
    """The same body to the single server and through the router: both answers (200s)."""
    out = []
    for url in (server.url, pd.router.url):
        r = httpx.post(url + path, json=body, timeout=300)
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out[0], out[1]


def _same_choices(want: dict, got: dict, abs_tol: float = 1e-3) -> None:
    assert [c["index"] for c in got["choices"]] == [c["index"] for c in want["choices"]]
    for w, g in zip(want["choices"], got["choices"], strict=True):
        assert g.get("text", g.get("message")) == w.get("text", w.get("message"))
        assert g["finish_reason"] == w["finish_reason"]
        if w.get("logprobs") and "token_logprobs" in w["logprobs"]:
            wl, gl = w["logprobs"], g["logprobs"]
            assert gl["tokens"] == wl["tokens"] and gl["text_offset"] == wl["text_offset"]
            gv, wv = gl["token_logprobs"], wl["token_logprobs"]
            assert [x is None for x in gv] == [x is None for x in wv]  # echo: the first is null
            assert [x for x in gv if x is not None] == pytest.approx(
                [x for x in wv if x is not None], abs=abs_tol
            )
    for k in ("prompt_tokens", "completion_tokens"):
        assert got["usage"][k] == want["usage"][k], k


def test_n_samples_and_batches_match_single_server(pd, server):
    """n > 1 (greedy and seeded) and batched prompts through PD: the router sends one PD request
    per prompt and sample, seeds sample j as one server does (seed + j), and merges in order."""
    greedy = {"model": MODEL, "prompt": ["1, 2, 3,", "The capital of France is"], "n": 2,
              "max_tokens": 5, "temperature": 0, "logprobs": 1}  # fmt: skip
    _same_choices(*_both(pd, server, "/v1/completions", greedy))
    seeded = {"model": MODEL, "prompt": "Once upon a time", "n": 3, "max_tokens": 8,
              "temperature": 1.0, "seed": 7}  # fmt: skip
    want, got = _both(pd, server, "/v1/completions", seeded)
    _same_choices(want, got)
    assert len({c["text"] for c in want["choices"]}) > 1  # the samples differ: seeds apply
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
            "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 3}  # fmt: skip
    want, _ = _both(pd, server, "/v1/chat/completions", chat)
    _same_choices(want, _)
    contents: dict[int, str] = {}
    for chunk in client(pd.router.url).chat.completions.create(**chat, stream=True):
        for ch in chunk.choices:
            contents[ch.index] = contents.get(ch.index, "") + (ch.delta.content or "")
    assert contents == {c["index"]: c["message"]["content"] for c in want["choices"]}
    # Streamed through the router: the official client sees the same choices and one usage.
    c = client(pd.router.url)
    texts, usage = {}, None
    stream = c.completions.create(**{**seeded, "prompt": ["Once upon a time", "Hello"]},
                                  stream=True, stream_options={"include_usage": True})  # fmt: skip
    ids = set()
    for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    want, _ = _both(
        pd, server, "/v1/completions", {**seeded, "prompt": ["Once upon a time", "Hello"]}
    )
    assert texts == {ch["index"]: ch["text"] for ch in want["choices"]} and len(ids) == 1
    assert usage.completion_tokens == want["usage"]["completion_tokens"]
    assert usage.prompt_tokens == want["usage"]["prompt_tokens"]
    pd.wait_idle()


def test_prompt_logprobs_and_echo_match_single_server(pd, server):
    """echo + logprobs, vLLM's prompt_logprobs (completions and chat), max_tokens 0 and a
    streamed echo: prefill scores the prompt, the router merges its part into decode's answer."""
    prompt = STORY * 3  # longer than prefill's 64-token chunk: scored chunk by chunk
    echo = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 3,
            "temperature": 0}  # fmt: skip
    want, got = _both(pd, server, "/v1/completions", echo)
    _same_choices(want, got)
    assert len(got["choices"][0]["logprobs"]["tokens"]) == got["usage"]["prompt_tokens"] + 3
    for w, g in zip(want["choices"][0]["logprobs"]["top_logprobs"][1:], got["choices"][0]["logprobs"]["top_logprobs"][1:], strict=True):  # fmt: skip
        assert g == pytest.approx(w, abs=1e-3)
    want, got = _both(pd, server, "/v1/completions", {**echo, "max_tokens": 0})
    _same_choices(want, got)
    vllm = {"model": MODEL, "prompt": "The capital of France is", "prompt_logprobs": 2,
            "max_tokens": 2, "temperature": 0}  # fmt: skip
    want, got = _both(pd, server, "/v1/completions", vllm)
    _same_choices(want, got)
    _same_prompt_logprobs(
        want["choices"][0]["prompt_logprobs"], got["choices"][0]["prompt_logprobs"]
    )
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}],
            "prompt_logprobs": 1, "max_tokens": 2, "temperature": 0}  # fmt: skip
    want, got = _both(pd, server, "/v1/chat/completions", chat)
    _same_prompt_logprobs(want["prompt_logprobs"], got["prompt_logprobs"])
    runs = []  # a streamed echo: the prompt's entries lead the first chunk, on both
    for url in (server.url, pd.router.url):
        chunks = [
            c for ch in client(url).completions.create(**echo, stream=True) for c in ch.choices
        ]
        runs.append(("".join(c.text for c in chunks), chunks[0].logprobs))
    (want_text, want_first), (got_text, got_first) = runs
    assert got_text == want_text and got_first.tokens == want_first.tokens
    assert len(got_first.tokens) > 50  # the ~100 prompt tokens (and the first generated)
    assert got_first.token_logprobs[0] is None
    assert got_first.token_logprobs[1:] == pytest.approx(want_first.token_logprobs[1:], abs=1e-3)
    pd.wait_idle()


def _same_prompt_logprobs(want: list, got: list) -> None:
    assert got[0] is None and len(got) == len(want)
    for w, g in zip(want[1:], got[1:], strict=True):
        assert set(g) == set(w)
        for tok in w:
            assert g[tok]["rank"] == w[tok]["rank"]
            assert g[tok]["decoded_token"] == w[tok]["decoded_token"]
            assert g[tok]["logprob"] == pytest.approx(w[tok]["logprob"], abs=1e-3)


def test_lm_eval_batched_loglikelihood_through_pd(pd, server):
    """lm-eval's recorded batch (8 token-id prompts, echo, max_tokens 1, logprobs 1) through the
    router: the scores one server gives (it was a 400: batched prompts and echo refused)."""
    from pathlib import Path

    fx = json.loads((Path(__file__).parents[1] / "server" / "fixtures" / "lm_eval_loglikelihood_batch.json").read_text())  # fmt: skip
    want, got = _both(pd, server, "/v1/completions", fx["request"])
    _same_choices(want, got)
    for c, ctxlen in zip(got["choices"], fx["ctxlens"], strict=True):
        assert len(c["logprobs"]["token_logprobs"][ctxlen:-1]) > 0
    pd.wait_idle()


def test_sglang_bench_and_logprobs_through_pd(pd, server):
    """sglang bench_serving's recorded session runs against the router; SGLang logprobs (input
    from prefill, output from decode) equal one server's; a batch of texts too."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
    from test_generate_logprobs import replay_bench

    replay_bench(pd.router.url)
    body = {"text": "1, 2, 3, 4,", "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "return_text_in_logprobs": True}  # fmt: skip
    want, got = _both(pd, server, "/generate", body)
    for key in ("input_token_logprobs", "output_token_logprobs"):
        w, g = want["meta_info"][key], got["meta_info"][key]
        assert [x[1:] for x in g] == [x[1:] for x in w], key
        assert [x[0] for x in g[1:]] == pytest.approx([x[0] for x in w[1:]], abs=1e-3), key
    assert got["meta_info"]["input_token_logprobs"][0][0] is None
    with httpx.stream(
        "POST", pd.router.url + "/generate", json={**body, "stream": True}, timeout=300
    ) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert all(e["meta_info"]["input_token_logprobs"] == got["meta_info"]["input_token_logprobs"] for e in events)  # fmt: skip
    assert events[-1]["output_ids"] == got["output_ids"]
    assert len(got["meta_info"]["input_top_logprobs"]) == len(
        want["meta_info"]["input_top_logprobs"]
    )
    want, got = _both(pd, server, "/generate", {"text": ["Hello", "1, 2,"], "sampling_params": {"temperature": 0, "max_new_tokens": 3}})  # fmt: skip
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    pd.wait_idle()


def test_router_serves_the_utility_routes_and_server_metrics(pd, server):
    """/tokenize, /detokenize and /version answered by a server behind the router; /ping and
    HEAD /health by the router; its /metrics carries each server's engine metrics, labelled."""
    body = {"prompt": "Hello world", "add_special_tokens": False}
    want, got = _both(pd, server, "/tokenize", body)
    assert got == want and got["tokens"]
    r = httpx.post(pd.router.url + "/detokenize", json={"tokens": got["tokens"]}, timeout=30)
    assert r.json() == {"prompt": "Hello world"}
    assert httpx.get(pd.router.url + "/version", timeout=30).json()["version"]
    assert httpx.get(pd.router.url + "/ping", timeout=30).status_code == 200
    assert httpx.post(pd.router.url + "/ping", timeout=30).status_code == 200
    assert httpx.head(pd.router.url + "/health", timeout=30).status_code == 200
    text = httpx.get(pd.router.url + "/metrics", timeout=30).text
    for role, srv in (("prefill", pd.prefill), ("decode", pd.decode)):
        labels = f'server="{srv.url}",role="{role}"'
        assert f"kvrelay_router_server_scrape_ok{{{labels}}} 1" in text
        assert f"kvrelay_kv_pages_used{{{labels}}}" in text
    assert text.count("# TYPE kvrelay_kv_pages_used ") == 1  # one family, both servers in it
    assert "kvrelay_router_requests_total" in text
