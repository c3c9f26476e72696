"""`kvrelay repro`: the judging rules on hand-made turns, then real SmolLM2 servers. With the
token-swap fault flag, corruption is found at high concurrency at a rate that matches the flag's
probability, and none at concurrency 1; with the flag off, none over 200 sessions."""

from __future__ import annotations

import argparse
import json
import math
import sqlite3

import httpx
import pytest
from conftest import ServerProcess

from kvrelay.bench.detectors import Reply, detect
from kvrelay.bench.repro import add_repro_parser
from kvrelay.bench.repro_judge import Turn, judge_level, judge_turn
from kvrelay.bench.repro_sessions import SCHEMAS, after_turn, calls_to_make, initial_messages
from kvrelay.bench.verify import Output

P, K = 0.1, 4  # the fault: swap a sampled token with probability P while the batch exceeds K


def repro(*args: str) -> int:
    """`kvrelay repro ARGS` in this process, through the parser the CLI uses."""
    p = argparse.ArgumentParser(prog="kvrelay")
    add_repro_parser(p.add_subparsers(dest="command", required=True))
    a = p.parse_args(["repro", *args])
    return a.func(a)


def turn(tokens: str, tops: list[dict] | None = None, error: str | None = None) -> Turn:
    toks = tokens.split("|")
    reply = Reply(content="".join(toks), tokens=toks, finish_reason="length")
    out = Output(
        text="".join(toks),
        tokens=toks,
        token_logprobs=[-0.1] * len(toks),
        top_logprobs=tops or [{}] * len(toks),
        error=error,
    )
    return Turn({}, out, reply, [] if error else detect(reply, SCHEMAS))


# --- judging, on hand-made turns --------------------------------------------------------------------


def test_identical_turns_are_clean_and_a_swap_is_corrupt():
    ref = turn("The| file| is| empty")
    assert not judge_turn(0, 0, ref, turn("The| file| is| empty"), 0.1).corrupt
    v = judge_turn(0, 0, ref, turn("The| file| was| empty"), 0.1)
    assert v.corrupt and v.comparison.first_divergence == 2


def test_a_near_tie_to_the_runner_up_is_not_counted():
    tops = [{"A": -0.5, "B": -0.55}, {"x": -0.1, "y": -3.0}]
    ref = turn("A|x", tops)
    v = judge_turn(0, 0, ref, turn("B|x"), 0.1)
    assert v.diverged and v.near_tie and not v.corrupt
    assert judge_turn(0, 0, ref, turn("C|x"), 0.1).corrupt  # not the runner-up: damage
    assert judge_turn(0, 0, ref, turn("B|x"), 0.0).corrupt  # --near-tie 0 counts every one


def test_only_findings_the_reference_lacks_count():
    loop = "|".join([" I", " am", " sorry", "."] * 6)
    assert judge_turn(0, 0, turn(loop), turn(loop), 0.1).new_findings == []  # the model's habit
    v = judge_turn(0, 0, turn("|".join(f" w{i}" for i in range(24))), turn(loop), 0.1)
    assert [f.detector for f in v.new_findings] == ["ngram_loop"]


WORDS24 = [f" w{i}" for i in range(24)]
LOOP = [" I", " am", " sorry", "."] * 6


def test_a_loop_after_a_near_tie_is_reported_not_counted():
    # The reference hesitates at token 2 between " w2" and " X" (gap 0.05 nats); the test took
    # " X" and its different continuation loops: the model's habit on other text.
    tops = [{}, {}, {" w2": -0.5, " X": -0.55}] + [{}] * 21
    ref = turn("|".join(WORDS24), tops)
    test = turn("|".join([*WORDS24[:2], " X", *LOOP]))
    v = judge_turn(0, 0, ref, test, 0.1)
    assert v.near_tie and not v.corrupt and v.new_findings == []
    assert [f.detector for f in v.after_near_tie] == ["ngram_loop"]
    level, _ = judge_level(16, [[ref]], [[test]], 1.0, 0.1)
    assert level["corrupted"] == 0 and level["near_tie_turns"] == 1
    assert level["after_near_tie"]["ngram_loop"] == 1 and level["after_near_tie_turns"] == 1
    assert level["detectors"]["ngram_loop"] == 0
    # The same divergence where the reference was sure (gap 3 nats): damage, and the loop counts.
    sure = turn("|".join(WORDS24), [{}, {}, {" w2": -0.1, " X": -3.1}] + [{}] * 21)
    v = judge_turn(0, 0, sure, test, 0.1)
    assert v.corrupt and not v.near_tie and [f.detector for f in v.new_findings] == ["ngram_loop"]


def test_a_finding_in_the_matched_part_counts_even_before_a_near_tie():
    # A loop in the tokens the test shares with the reference, which the reference's own reply was
    # not found to have (its findings are what repro recorded for it): counted, near-tie or not.
    tokens = [*LOOP, " a", " b"]
    tops = [{}] * len(LOOP) + [{" a": -0.5, " c": -0.52}, {}]
    ref = turn("|".join(tokens), tops)
    ref.findings = []
    test = turn("|".join([*LOOP, " c", " b"]))
    v = judge_turn(0, 0, ref, test, 0.1)
    assert v.near_tie and v.corrupt and [f.detector for f in v.new_findings] == ["ngram_loop"]
    assert v.after_near_tie == []


def test_level_counts_sessions_and_excludes_incomplete_ones():
    ref = [[turn("a|b"), turn("c|d")], [turn("a|b"), turn("c|d")], [turn("a|b")]]
    tested = [
        [turn("a|b"), turn("c|X")],  # corrupt in turn 1
        [turn("a|b"), turn("", error="HTTP 500")],  # failed: not compared
        [turn("a|b")],
    ]
    level, _ = judge_level(16, ref, tested, 1.0, 0.1)
    assert (level["compared"], level["corrupted"], level["incomplete"]) == (2, 1, 1)
    assert level["rate"] == 0.5 and level["failed_requests"] == 1
    assert level["divergences"] == [[0, 1, 1]]


def test_sessions_are_seeded_and_tool_results_follow_the_calls():
    a, b = initial_messages(4, 7, 5), initial_messages(4, 7, 5)
    assert a == b and a != initial_messages(4, 8, 5)
    assert initial_messages(1, 0, 0, system="")[0][0]["role"] == "user"
    own = Reply(
        content='<tool_call>{"name": "run_tests", "arguments": {"target": "t"}}</tool_call>'
    )
    assert calls_to_make(own, 0, 3, 1)[0]["function"]["name"] == "run_tests"
    scripted = calls_to_make(Reply(content="no call here"), 0, 3, 1)
    assert scripted[0]["function"]["name"] in SCHEMAS
    msgs = after_turn(own, 0, 3, 1, 4)
    assert [m["role"] for m in msgs] == ["assistant", "tool"]
    assert msgs == after_turn(own, 0, 3, 1, 4)  # the simulated result is a pure function


# --- real servers -----------------------------------------------------------------------------------


@pytest.fixture
def fault_server():
    """Its own test's server only: stopped (KV pool freed) before the next test starts."""
    s = ServerProcess(
        "--model",
        "smollm2",
        "--max-total-tokens",
        "16384",
        "--max-num-batched-tokens",
        "512",
        "--test-fault-swap-token",
        f"{P},{K}",
    )
    yield s
    s.close()


def faultable_fraction(url: str, since: int, tokens: int) -> tuple[float, float]:
    """Bounds on the share of `tokens` sampled in steps whose batch exceeded K: such a step samples
    one token per decoding sequence, plus one per prefill that finished in it."""
    steps = httpx.get(f"{url}/telemetry/steps", params={"since": since}, timeout=10).json()
    assert steps["dropped"] == 0
    big = [s for s in steps["steps"] if s["batch_size"] > K]
    lo = sum(s["batch_size"] - s["num_prefill"] for s in big)
    hi = sum(s["batch_size"] for s in big)
    return lo / tokens, min(1.0, hi / tokens)


def test_fault_flag_corruption_found_at_the_rate_p_predicts(fault_server, tmp_path):
    url, turns, max_tokens, n = fault_server.url, 2, 8, 16
    head = httpx.get(f"{url}/telemetry/steps", params={"limit": 0}, timeout=10).json()["head"]
    ledger, out = tmp_path / "ledger.db", tmp_path / "repro.json"
    # The reference runs K sessions at a time, so its batches never exceed K: it is clean.
    rc = repro(
        *f"--base-url {url} --concurrency 1,16 --reference-concurrency {K} --num-sessions {n}".split(),
        *f"--turns {turns} --max-tokens {max_tokens} --ignore-eos --task-words 0".split(),
        # A one-word system prompt: prefill is what costs on CPU (the tools stay in each request).
        *f"--system-prompt=Agent. --tool-result-len 4 --ledger {ledger} --output-json {out}".split(),
    )
    result = json.loads(out.read_text())
    assert rc == 1, fault_server.log()
    c1, c16 = result["levels"]
    assert c1["concurrency"] == 1 and c1["corrupted"] == 0 and c1["compared"] == n
    assert c1["divergent_turns"] == 0
    assert c16["compared"] == n and c16["corrupted"] > 0 and c16["failed_requests"] == 0
    # The baseline: the reference's own findings, and the note that it ran batched (at K).
    assert result["reference"]["batched"] and "detectors" in result["reference"]
    assert set(c16["after_near_tie"]) == set(c16["detectors"])

    # Only the concurrency-16 pass had batches above K; ignore_eos makes every turn max_tokens.
    f_lo, f_hi = faultable_fraction(url, head, c16["output_tokens"])
    assert c16["output_tokens"] == n * turns * max_tokens
    # Per turn: the first swap is the first divergence. Tokens exposed to the fault = those up to
    # and including the first divergence, or the whole turn; P_hat = divergences / exposed.
    divs = c16["divergences"]
    exposed = sum(pos + 1 for _, _, pos in divs) + (c16["turns"] - len(divs)) * max_tokens
    p_lo, p_hi = len(divs) / (f_hi * exposed), len(divs) / (f_lo * exposed)
    slack = 1 + 3 / math.sqrt(len(divs))  # ~3 sigma of a count
    assert p_lo / slack <= P <= p_hi * slack, (p_lo, p_hi, divs)
    # Per session: P(corrupt) = 1 - (1-P)^(f * tokens); its band must meet the Wilson interval.
    expect = [1 - (1 - P) ** (f * turns * max_tokens) for f in (f_lo, f_hi)]
    lo, hi = c16["ci95"]
    assert lo <= expect[1] and expect[0] <= hi, (expect, c16["ci95"])

    assert result["examples"] and "[[" in result["examples"][0]["highlight"]
    with sqlite3.connect(ledger) as db:
        assert db.execute("SELECT kind FROM runs").fetchall() == [("repro",)]


def test_no_false_positives_over_200_sessions(server, tmp_path):
    """Flag off: 200 sessions at concurrency 32 match a reference run at 8 exactly (different
    batch mixes). Kept cheap for a 2-core CPU: one turn each (prefill is the cost; multi-turn
    replay is covered above), no `tools` field (SmolLM2's server would add a tool prompt of a
    few hundred tokens to every request), and a reference at 8 rather than 200 one by one."""
    out = tmp_path / "repro.json"
    rc = repro(
        f"--base-url={server.url}",
        *"--concurrency 32 --reference-concurrency 8 --num-sessions 200 --turns 1".split(),
        *"--max-tokens 8 --task-words 0 --system-prompt=Agent. --no-tools-field".split(),
        *f"--ledger off --output-json {out}".split(),
    )
    result = json.loads(out.read_text())
    (level,) = result["levels"]
    assert rc == 0, (result["examples"], server.log())
    assert level["compared"] == 200 and level["corrupted"] == 0
    assert level["divergent_turns"] == 0 and level["near_tie_turns"] == 0
    assert level["ci95"][1] < 0.02


def test_same_tokens_different_text_is_no_near_tie():
    ref = turn("A|x", [{"A": -0.5, "B": -0.55}, {}])
    test = turn("A|x")
    test.output.text = "A x"  # the detokeniser disagreed: damage, not numerics
    v = judge_turn(0, 0, ref, test, 0.1)
    assert v.diverged and not v.near_tie and v.corrupt
