"""`kvrelay bench` reads a speculating server's counters: the mean accepted length of a level
(1 + accepted / drafts) in its server figures and in the summary table."""

from __future__ import annotations

import pytest

from kvrelay.bench.metrics import parse_prometheus, server_delta
from kvrelay.bench.report import table_rows

BEFORE = """kvrelay_spec_decode_num_drafts_total 10.0
kvrelay_spec_decode_num_draft_tokens_total 40.0
kvrelay_spec_decode_num_accepted_tokens_total 12.0
"""
AFTER = """kvrelay_spec_decode_num_drafts_total 30.0
kvrelay_spec_decode_num_draft_tokens_total 120.0
kvrelay_spec_decode_num_accepted_tokens_total 42.0
"""


def _level(server: dict) -> dict:
    lat = {"p50": 1.0, "p99": 2.0}
    return {
        "mode": "closed", "concurrency": 1, "completed": 1, "failed": 0,
        "request_throughput": 1.0, "output_throughput": 1.0, "server": server,
        "counters_agree": None, **{k: lat for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")},
    }  # fmt: skip


def test_mean_accepted_length_per_level():
    d = server_delta(parse_prometheus(BEFORE), parse_prometheus(AFTER))
    assert d["spec_decode_draft_tokens"] == 80 and d["spec_decode_accepted_tokens"] == 30
    assert d["spec_decode_mean_accepted_length"] == pytest.approx(1 + 30 / 20)
    plain = server_delta({}, {})
    assert plain["spec_decode_mean_accepted_length"] is None
    result = {"config": {"percentiles": [50, 99], "slo": None}, "levels": [_level(d)]}
    header, rows = table_rows(result)
    assert header[-1] == "accept len" and rows[0][-1] == "2.50"
    result["levels"] = [_level(plain)]
    assert "accept len" not in table_rows(result)[0]  # a plain server: no column
