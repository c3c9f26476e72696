"""The bench's statistics against values computed by hand."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvrelay.bench.metrics import (
    RequestRecord,
    group_errors,
    level_summary,
    meets_slo,
    metric_total,
    parse_prometheus,
    parse_slo,
    percentile,
    server_delta,
    summarize,
)

approx = pytest.approx


def test_percentile_interpolates_between_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 50) == 2.5  # halfway between ranks 1 and 2 (2 and 3)
    assert percentile(xs, 90) == approx(3.7)  # h = 3 * 0.9 = 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(xs, 99) == approx(3.97)
    assert percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_agrees_with_numpy():
    rng = random.Random(0)
    for n in (1, 2, 5, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(xs, q) == approx(float(np.percentile(xs, q)))


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_textbook_example():
    s = summarize([2, 4, 4, 4, 5, 5, 7, 9], (50, 90))
    # mean 5; squared deviations 9+1+1+1+0+0+4+16 = 32; population variance 4.
    assert s == {
        "count": 8,
        "mean": 5.0,
        "std": 2.0,
        "min": 2,
        "max": 9,
        "p50": 4.5,
        "p90": approx(7.6),
    }
    assert summarize([0.002, 0.004], (50,), scale=1e3)["p50"] == approx(3.0)


def test_summarize_empty_has_keys_and_no_values():
    assert summarize([], (50, 99)) == {
        "count": 0,
        "mean": None,
        "std": None,
        "min": None,
        "max": None,
        "p50": None,
        "p99": None,
    }
    assert "p99_9" in summarize([1.0], (99.9,))


def test_tpot_excludes_the_first_token():
    r = RequestRecord(success=True, ttft=0.2, e2e=1.0, output_tokens=5)
    assert r.tpot == approx(0.2)  # (1.0 - 0.2) / (5 - 1)
    assert RequestRecord(success=True, ttft=0.2, e2e=1.0, output_tokens=1).tpot is None
    assert RequestRecord(success=False, ttft=0.2, e2e=1.0, output_tokens=5).tpot is None


def test_parse_slo_both_syntaxes():
    assert parse_slo("ttft=200,tpot=50") == {"ttft": 200.0, "tpot": 50.0}
    assert parse_slo("ttft:200 tpot:50 e2el:3000") == {"ttft": 200.0, "tpot": 50.0, "e2el": 3000.0}
    for bad in ("itl=5", "ttft=abc", "ttft=-1", "ttft", "ttft=0"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_meets_slo():
    r = RequestRecord(success=True, ttft=0.15, e2e=0.55, output_tokens=5)  # tpot 100 ms
    assert meets_slo(r, {"ttft": 200})
    assert not meets_slo(r, {"ttft": 100})
    assert meets_slo(r, {"ttft": 200, "tpot": 100})  # bounds are inclusive
    assert not meets_slo(r, {"tpot": 99})
    assert not meets_slo(r, {"e2el": 500})
    one_token = RequestRecord(success=True, ttft=0.1, e2e=0.1, output_tokens=1)
    assert meets_slo(one_token, {"tpot": 1})  # no TPOT: passes, as in vLLM
    assert not meets_slo(RequestRecord(success=False, error="x"), {"ttft": 1e9})


def _records() -> list[RequestRecord]:
    r1 = RequestRecord(
        success=True,
        ttft=0.1,
        itl=[0.05, 0.05, 0.05],
        e2e=0.25,
        prompt_tokens=10,
        output_tokens=4,
        finish_reason="length",
    )  # tpot 50 ms
    r2 = RequestRecord(
        success=True,
        ttft=0.3,
        itl=[0.1],
        e2e=0.4,
        prompt_tokens=20,
        output_tokens=2,
        finish_reason="stop",
    )  # tpot 100 ms
    r3 = RequestRecord(success=False, error="HTTP 500: boom")
    return [r1, r2, r3]


def test_level_summary_by_hand():
    s = level_summary(_records(), duration_s=2.0, slo=None, percentiles=(50, 99))
    assert (s["num_requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 6)
    assert s["request_throughput"] == approx(1.0)  # 2 completed / 2 s
    assert s["output_throughput"] == approx(3.0)  # 6 tokens / 2 s
    assert s["total_token_throughput"] == approx(18.0)  # 36 tokens / 2 s
    assert s["mean_concurrency"] == approx(0.325)  # (0.25 + 0.4) / 2 s
    assert s["ttft_ms"]["mean"] == approx(200.0) and s["ttft_ms"]["p50"] == approx(200.0)
    assert s["ttft_ms"]["p99"] == approx(298.0)  # 100 + 0.99 * 200
    assert s["tpot_ms"]["mean"] == approx(75.0) and s["tpot_ms"]["count"] == 2
    # ITL pools every gap: [50, 50, 50, 100] ms.
    assert s["itl_ms"]["count"] == 4
    assert s["itl_ms"]["mean"] == approx(62.5) and s["itl_ms"]["p50"] == approx(50.0)
    assert s["e2el_ms"]["p50"] == approx(325.0)
    assert s["input_tokens"]["mean"] == approx(15.0)
    assert s["finish_reasons"] == {"length": 1, "stop": 1}
    assert s["errors"] == [{"error": "HTTP 500: boom", "count": 1}]
    # Without SLOs every completed request is good.
    assert s["good_requests"] == 2 and s["goodput"] == approx(1.0)


def test_goodput_counts_requests_within_every_slo():
    recs = _records()
    assert level_summary(recs, 2.0, {"ttft": 150})["good_requests"] == 1  # r2's TTFT is 300 ms
    assert level_summary(recs, 2.0, {"ttft": 150})["goodput"] == approx(0.5)
    assert level_summary(recs, 2.0, {"tpot": 60})["good_requests"] == 1  # r2's TPOT is 100 ms
    assert level_summary(recs, 2.0, {"ttft": 1000, "tpot": 1000})["goodput"] == approx(1.0)
    assert level_summary(recs, 2.0, {"e2el": 100})["good_requests"] == 0


def test_errors_that_differ_in_numbers_group_together():
    errs = [
        "HTTP 400: prompt has 9000 tokens",
        "timeout after 5s",
        "HTTP 400: prompt has 9001 tokens",
        "HTTP 400: prompt has 9000 tokens",
    ]
    assert group_errors(errs) == [
        {"error": "HTTP 400: prompt has 9000 tokens", "count": 3},
        {"error": "timeout after 5s", "count": 1},
    ]


def test_level_summary_of_only_failures():
    s = level_summary([RequestRecord(error="timeout after 5s")], 1.0)
    assert s["completed"] == 0 and s["failed"] == 1 and s["ttft_ms"]["p50"] is None
    assert s["request_throughput"] == 0.0


BEFORE = """\
# HELP kvrelay_requests_total finished requests by finish reason
# TYPE kvrelay_requests_total counter
# TYPE kvrelay_generation_tokens_total counter
kvrelay_generation_tokens_total 100.0
# TYPE kvrelay_prompt_tokens_total counter
kvrelay_prompt_tokens_total 1000.0
# TYPE kvrelay_engine_step_seconds histogram
kvrelay_engine_step_seconds_bucket{le="0.1"} 3.0
kvrelay_engine_step_seconds_count 10.0
kvrelay_engine_step_seconds_sum 0.5
kvrelay_num_requests_running 0.0
"""

AFTER = """\
# TYPE kvrelay_requests_total counter
kvrelay_requests_total{finish_reason="length"} 3.0
kvrelay_requests_total{finish_reason="stop"} 1.0
# TYPE kvrelay_generation_tokens_total counter
kvrelay_generation_tokens_total 164.0
# TYPE kvrelay_prompt_tokens_total counter
kvrelay_prompt_tokens_total 1512.0
kvrelay_engine_step_seconds_count 30.0
kvrelay_engine_step_seconds_sum 1.5
kvrelay_num_requests_running 4.0
odd_metric{path="a,b",q="say \\"hi\\""} 2e3 1700000000
"""


def test_parse_prometheus():
    s = parse_prometheus(AFTER)
    assert s["kvrelay_requests_total"] == [
        ({"finish_reason": "length"}, 3.0),
        ({"finish_reason": "stop"}, 1.0),
    ]
    assert metric_total(s, "kvrelay_requests_total") == 4.0
    assert s["odd_metric"] == [({"path": "a,b", "q": 'say \\"hi\\"'}, 2000.0)]
    assert metric_total(s, "absent") is None
    # Declared but without samples (a labelled counter before its first use) counts as zero.
    assert metric_total(parse_prometheus(BEFORE), "kvrelay_requests_total") == 0.0


def test_server_delta():
    d = server_delta(parse_prometheus(BEFORE), parse_prometheus(AFTER))
    assert d["requests"] == 4.0
    assert d["requests_by_finish_reason"] == {"length": 3.0, "stop": 1.0}
    assert d["generation_tokens"] == 64.0
    assert d["prompt_tokens"] == 512.0
    assert d["engine_steps"] == 20.0
    assert d["engine_step_mean_ms"] == approx(50.0)  # 1.0 s over 20 steps
    assert d["request_errors"] is None  # not exported by this server


def test_server_delta_of_a_server_without_kvrelay_metrics():
    d = server_delta({}, {})
    assert (
        d["requests"] is None
        and d["generation_tokens"] is None
        and d["engine_step_mean_ms"] is None
    )
