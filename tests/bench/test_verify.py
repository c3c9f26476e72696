"""`kvrelay verify`: the comparison logic on hand-made outputs, a server against itself (identical),
and against a server with a planted token swap (found, at position 0)."""

from __future__ import annotations

import argparse
import json

import pytest
from conftest import ServerProcess

from kvrelay.bench.cli import add_bench_parser
from kvrelay.bench.verify import (
    Output,
    bucket_label,
    compare,
    divergence_histogram,
    exit_code,
    first_divergence,
    summarize,
    top2_gap,
)

SMALL = "--num-prompts 4 --input-len 24 --output-len 8"


def verify(args: str) -> int:
    """`kvrelay verify ARGS` in this process, through the parser the CLI uses."""
    p = argparse.ArgumentParser(prog="kvrelay")
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    a = p.parse_args(["verify", *args.split()])
    return a.func(a)


def out(tokens: str, lps: list[float] | None = None, tops: list[dict] | None = None) -> Output:
    toks = tokens.split()
    return Output(
        text="".join(toks),
        tokens=toks,
        token_logprobs=lps if lps is not None else [-0.5] * len(toks),
        top_logprobs=tops if tops is not None else [{}] * len(toks),
    )


# --- pure logic -------------------------------------------------------------------------------------


def test_first_divergence():
    assert first_divergence(["a", "b"], ["a", "b"]) is None
    assert first_divergence(["a", "b"], ["x", "b"]) == 0
    assert first_divergence(["a", "b", "c"], ["a", "b", "x"]) == 2
    assert first_divergence(["a", "b"], ["a", "b", "c"]) == 2  # one output stopped early
    assert first_divergence([], []) is None


def test_top2_gap():
    assert top2_gap({"a": -0.1, "b": -2.1}) == pytest.approx(2.0)
    assert top2_gap({"b": -2.1, "a": -0.1}) == pytest.approx(2.0)
    assert top2_gap({"a": -0.1}) is None
    assert top2_gap(None) is None


def test_identical_outputs_and_logprob_delta():
    a = out("x y z", [-0.1, -0.2, -0.3])
    b = out("x y z", [-0.1, -0.25, -0.3])
    c = compare(0, a, b)
    assert c.identical and c.first_divergence is None
    assert c.max_logprob_delta == pytest.approx(0.05)
    assert c.a_text is None  # texts kept only for differences


def test_near_tie_vs_real_difference():
    tops = [{"x": -0.1, "q": -3.0}, {"y": -0.69, "w": -0.70}, {"z": -0.1, "v": -4.0}]
    ref = out("x y z", [-0.1, -0.69, -0.1], tops)
    # Divergence at 1 where A's top-2 are 0.01 apart, and B picked A's runner-up: a near-tie.
    tie = compare(0, ref, out("x w z", [-0.3, -0.70, -0.1]))
    assert not tie.identical and tie.first_divergence == 1
    assert tie.a_token == "y" and tie.b_token == "w"
    assert tie.ref_top2_gap == pytest.approx(0.01) and tie.near_tie
    assert tie.b_token_in_ref_top
    assert tie.max_logprob_delta == pytest.approx(0.2)  # only the common prefix (position 0)
    # Divergence at 2 where A was 3.9 nats sure, to a token outside A's top-2: a real difference.
    real = compare(1, ref, out("x y BAD"))
    assert real.first_divergence == 2 and real.near_tie is False
    assert real.b_token_in_ref_top is False
    assert real.a_text == "xyz" and real.b_text == "xyBAD"


def test_histogram_buckets():
    assert [bucket_label(p) for p in (0, 1, 2, 3, 4, 7, 8, 100)] == [
        "0",
        "1",
        "2-3",
        "2-3",
        "4-7",
        "4-7",
        "8-15",
        "64-127",
    ]
    assert divergence_histogram([5, 0, 0, 2, 9]) == {"0": 2, "2-3": 1, "4-7": 1, "8-15": 1}


def test_summary_and_exit_codes():
    ref = out("a b c", tops=[{"a": -0.1, "b": -0.12}] * 3)
    same = compare(0, ref, out("a b c"))
    tie = compare(1, ref, out("b b c"))
    err = compare(2, ref, Output(error="HTTP 500"))
    s = summarize([same, same])
    assert s["verdict"] == "identical" and s["identical"] == 2 and exit_code(s) == 0
    assert s["divergence_histogram"] == {} and s["mean_logprob_delta"] == 0.0
    s = summarize([same, tie])
    assert s["verdict"] == "near-ties only" and s["near_tie"] == 1 and exit_code(s) == 1
    assert s["divergence_histogram"] == {"0": 1}
    s = summarize([same, err])
    assert s["verdict"] == "incomplete" and s["errors"] == 1 and exit_code(s) == 2
    s = summarize([compare(0, ref, out("a b c d")), err])  # a difference outranks an error
    assert s["verdict"] == "different" and exit_code(s) == 1


# --- live -------------------------------------------------------------------------------------------


def test_server_against_itself_is_identical(server, tmp_path):
    rc = verify(
        f"{server.url} {server.url} {SMALL} --concurrency-a 1 --concurrency-b 8 "
        f"--result-dir {tmp_path} --result-filename same.json"
    )
    result = json.loads((tmp_path / "same.json").read_text())
    assert rc == 0, result["prompts"]
    s = result["summary"]
    assert s["verdict"] == "identical" and s["identical"] == 4 and s["different"] == 0
    assert s["divergence_histogram"] == {} and s["max_logprob_delta"] is not None
    assert result["a"]["concurrency"] == 1 and result["b"]["concurrency"] == 8
    assert result["a"]["output_tokens"] == result["b"]["output_tokens"] == 4 * 8
    assert result["exit_code"] == 0


def test_planted_difference_is_found(server, tmp_path):
    faulty = ServerProcess(
        "--model", "smollm2", "--max-total-tokens", "8192", "--test-fault-swap-token", "1.0,0"
    )
    try:
        rc = verify(
            f"{server.url} {faulty.url} {SMALL} --result-dir {tmp_path} --result-filename d.json"
        )
    finally:
        faulty.close()
    result = json.loads((tmp_path / "d.json").read_text())
    assert rc == 1 and result["exit_code"] == 1
    s = result["summary"]
    assert s["different"] == 4 and s["identical"] == 0 and s["errors"] == 0
    assert s["verdict"] in ("different", "near-ties only")
    assert s["divergence_histogram"] == {"0": 4}
    assert all(p["first_divergence"] == 0 and not p["identical"] for p in result["prompts"])
