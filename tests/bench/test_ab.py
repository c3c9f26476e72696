"""`kvrelay ab`: the t table and the paired interval, the verdicts, and A/B of the test server
against itself (the interval must contain 0), recorded with its decision in the ledger."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest

from kvrelay.bench.ab import verdict
from kvrelay.bench.cli import add_bench_parser
from kvrelay.bench.confidence import paired_relative_difference, t_quantile
from kvrelay.ledger.report import render


def test_t_quantiles():
    assert t_quantile(1) == 12.706 and t_quantile(4) == 2.776 and t_quantile(30) == 2.042
    assert t_quantile(2, 0.99) == 9.925 and t_quantile(9, 0.90) == 1.833
    assert t_quantile(35) == pytest.approx(2.030, abs=0.002)  # between the table's rows
    assert t_quantile(10**9) == pytest.approx(1.960, abs=1e-6)
    with pytest.raises(ValueError):
        t_quantile(0)


def test_paired_relative_difference():
    a = [100.0, 110.0, 90.0, 105.0]
    d = paired_relative_difference(a, [x * 1.10 for x in a])  # +10% in every pair, whatever drift
    assert d["mean"] == pytest.approx(0.10) and d["half_width"] == pytest.approx(0, abs=1e-12)
    assert d["significant"] and d["n"] == 4
    d = paired_relative_difference([100.0, 100.0, 100.0], [102.0, 98.0, 100.0])
    # mean 0, sd 0.02, n 3: half-width t(2) * 0.02 / sqrt(3)
    assert d["mean"] == pytest.approx(0) and d["half_width"] == pytest.approx(4.303 * 0.02 / 3**0.5)
    assert not d["significant"] and d["low"] < 0 < d["high"]
    one = paired_relative_difference([10.0], [11.0])
    assert one["half_width"] is None and not one["significant"]


def test_verdicts():
    diff = {"mean": 0.128, "half_width": 0.021, "significant": True, "confidence": 0.95}
    assert verdict("output_throughput", diff, 64) == (
        "B is +12.8% ± 2.1% output tok/s at concurrency 64 (better)"
    )
    assert verdict("ttft", diff, 8).endswith("mean TTFT at concurrency 8 (worse)")
    flat = diff | {"mean": 0.004, "half_width": 0.031, "significant": False}
    assert verdict("output_throughput", flat, 64) == (
        "no significant difference (B is +0.4% ± 3.1% output tok/s at concurrency 64; "
        "95% CI contains 0)"
    )
    assert "one trial" in verdict("tpot", diff | {"half_width": None}, 1)


def ab(args: str) -> int:
    p = argparse.ArgumentParser(prog="kvrelay")
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    a = p.parse_args(["ab", *shlex.split(args)])
    return a.func(a)


def test_ab_of_the_server_against_itself(server, tmp_path, ledger, capsys):
    # An even number of trials: with abba order each side runs first equally often, so a
    # position effect (the second run of a trial finding warm caches, say) cancels in the mean
    # instead of posing as a difference (3 trials, B second twice, once gave -7% +- 6.3%).
    trials = 4
    rc = ab(
        f"--a-url {server.url} --b-url {server.url} --trials {trials} --concurrency 2 --order abba "
        "--num-prompts 4 --input-len 32 --output-len 8 --num-warmups 1 --disable-progress "
        f"--confidence 0.99 --result-dir {tmp_path} --result-filename ab.json "
        "--decide reject --reason no-gain-expected"
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    r = json.loads((tmp_path / "ab.json").read_text())
    assert len(r["trials"]) == trials and r["failed"] == 0
    assert [t["order"] for t in r["trials"]] == ["ab", "ba", "ab", "ba"]  # B first in odd trials
    for t in r["trials"]:
        for side in ("a", "b"):
            assert t[side]["completed"] == 4 and t[side]["output_throughput"] > 0
    # The same configuration against itself: no significant difference in anything measured
    # (at 99% confidence, so that noise on a shared machine fails this about once in 100 runs).
    for name, d in r["differences"].items():
        assert d["n"] == trials and d["low"] <= 0 <= d["high"], (name, d)
    assert r["verdict"].startswith("no significant difference (B is ")
    assert "output tok/s at concurrency 2; 99% CI contains 0)" in r["verdict"]
    assert f"verdict: {r['verdict']}" in out and "recorded as run #1" in out
    # The ledger holds the run and the decision; the report lists it as not to retread.
    md = render(ledger)
    assert "## Do not retread" in md
    assert "- **no difference in /server_info**: no-gain-expected (evidence: no significant" in md


def test_ab_flag_errors(capsys):
    assert ab("--a-url http://x --trials 2") == 2
    assert "exactly one of --b-url and --b-serve" in capsys.readouterr().err
    assert ab("--a-url http://x --b-url http://y --decide accept") == 2
    assert "--decide needs --reason" in capsys.readouterr().err


def test_ab_server_that_does_not_start(tmp_path, capsys):
    missing = tmp_path / "missing.gguf"
    rc = ab(f"--a-serve='--model {missing}' --b-url http://x --result-dir {tmp_path}")
    assert rc == 2
    assert "`kvrelay serve` exited with code" in capsys.readouterr().err
    assert (tmp_path / "ab-server-a.log").exists()
