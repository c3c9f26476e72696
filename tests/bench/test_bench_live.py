"""`kvrelay bench` against the real SmolLM2 server: a closed-loop sweep and an open-loop Poisson run
whose counts equal the server's own /metrics counters, the multi-turn workloads, and the files."""

from __future__ import annotations

import argparse
import json
import random
import socket
import sqlite3
from pathlib import Path

import httpx
import matplotlib.image
import pytest

from kvrelay.bench.cli import add_bench_parser
from kvrelay.bench.workloads import (
    TOOL_NAMES,
    Response,
    TextCalibration,
    WorkloadConfig,
    build_sessions,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COUNTERS = (
    "kvrelay_requests_total",
    "kvrelay_generation_tokens_total",
    "kvrelay_prompt_tokens_total",
)


def bench(args: str) -> int:
    """`kvrelay bench ARGS` in this process, through the same parser the CLI uses."""
    p = argparse.ArgumentParser(prog="kvrelay")
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    a = p.parse_args(["bench", *args.split()])
    return a.func(a)


def counters(url: str) -> dict[str, float]:
    """The server's counters summed over labels, parsed here independently of the bench's parser."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in COUNTERS:
            if line.startswith((name + " ", name + "{")):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def run_bench(server, tmp_path, args: str, expect_rc: int = 0) -> dict:
    before = counters(server.url)
    common = f"--base-url {server.url} --result-dir {tmp_path} --result-filename run.json --disable-progress"
    rc = bench(f"{common} --metrics-interval 0.2 {args}")
    after = counters(server.url)
    assert rc == expect_rc, server.log()
    result = json.loads((tmp_path / "run.json").read_text())
    # Everything the bench sent (calibration probes and warm-ups in `preamble`, then the levels) is
    # exactly what the server counted over the run.
    levels, pre = result["levels"], result["preamble"]
    delta = {k: after[k] - before[k] for k in COUNTERS}
    assert delta["kvrelay_requests_total"] == pre["requests"] + sum(
        lv["completed"] for lv in levels
    )
    assert delta["kvrelay_generation_tokens_total"] == pre["output_tokens"] + sum(
        lv["total_output_tokens"] for lv in levels
    )
    assert delta["kvrelay_prompt_tokens_total"] == pre["prompt_tokens"] + sum(
        lv["total_input_tokens"] for lv in levels
    )
    # And per level, the bench's own scrapes say the same.
    for lv in levels:
        assert lv["server"]["requests"] == lv["completed"]
        assert lv["server"]["generation_tokens"] == lv["total_output_tokens"]
        assert lv["counters_agree"] is True
    assert result["totals"]["counters_agree"] is True
    return result


def check_stats(stats: dict, count: int) -> None:
    assert stats["count"] == count
    assert 0 <= stats["min"] <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    assert stats["min"] <= stats["mean"] <= stats["max"]


def check_png(path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    img = matplotlib.image.imread(str(path))  # decodes: a whole, valid PNG
    assert img.shape[0] > 200 and img.shape[1] > 200


def test_closed_loop_sweep(server, tmp_path, ledger):
    n, out_len = 6, 4
    args = f"--input-len 64 --output-len {out_len} --concurrency 1,4 --num-prompts {n}"
    r = run_bench(server, tmp_path, args + " --slo ttft=600000,tpot=600000")
    assert r["schema_version"] == 1 and r["kind"] == "kvrelay.bench" and r["model"] == "smollm2"
    assert r["config"]["mode"] == "closed" and r["config"]["workload"]["dataset"] == "random"
    assert r["preamble"]["requests"] == 3  # two calibration probes and one warm-up
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 4]
    for lv in r["levels"]:
        assert (lv["num_requests"], lv["completed"], lv["failed"]) == (n, n, 0)
        assert lv["errors"] == []
        # ignore_eos: every request generated exactly --output-len tokens.
        assert lv["output_tokens"]["min"] == lv["output_tokens"]["max"] == out_len
        assert lv["total_output_tokens"] == n * out_len
        assert lv["finish_reasons"] == {"length": n}
        assert lv["server"]["requests_by_finish_reason"] == {"length": n}
        # Prompts are sized by calibration, then measured by the server's usage.
        assert 58 <= lv["input_tokens"]["mean"] <= 70
        for key in ("ttft_ms", "tpot_ms", "e2el_ms"):
            check_stats(lv[key], n)
        # kvrelay streams one chunk per token: every token after the first has its own gap.
        check_stats(lv["itl_ms"], n * (out_len - 1))
        assert lv["ttft_ms"]["max"] <= lv["e2el_ms"]["max"]
        assert lv["request_throughput"] == pytest.approx(n / lv["duration_s"])
        assert lv["output_throughput"] == pytest.approx(n * out_len / lv["duration_s"])
        # Time-averaged requests in flight cannot exceed the number of users; nor can the server's.
        assert 0 < lv["mean_concurrency"] <= lv["concurrency"] + 1e-6
        assert lv["server_peaks"]["num_requests_running"] <= lv["concurrency"]
        assert lv["good_requests"] == n  # SLOs of ten minutes
        assert lv["server"]["engine_steps"] > 0 and lv["server"]["engine_step_mean_ms"] > 0
    # The step-time model, fitted over the decode steps of both levels (batch 1 and up to 4).
    fit = r["step_fit"]
    assert fit["n"] >= 2 * n * (out_len - 1) // 4 and fit["batch_min"] == 1
    assert fit["batch_max"] > 1 and fit["a_ms"] is not None and fit["b_ms_per_seq"] is not None
    assert all(lv["step_fit"]["n"] > 0 and lv["steps_dropped"] == 0 for lv in r["levels"])
    # The run is in the ledger with the server's configuration and the same results.
    conn = sqlite3.connect(ledger)
    (row,) = conn.execute("SELECT kind, workload, server_info, results FROM runs").fetchall()
    conn.close()
    assert row[:2] == ("bench", "random in=64 out=4 c=1,4")
    info = json.loads(row[2])
    assert info["config"]["engine"]["scheduler"]["max_num_batched_tokens"] == 128
    assert json.loads(row[3])["step_fit"] == fit
    plots = [tmp_path / "run-latency.png", tmp_path / "run-throughput.png"]
    assert r["plots"] == [str(p) for p in plots]
    for p in plots:
        check_png(p)


def test_open_loop_poisson(server, tmp_path):
    n = 5
    args = f"--input-len 32 --output-len 3 --request-rate 4 --num-prompts {n} --num-warmups 0"
    r = run_bench(server, tmp_path, args + " --save-detailed --no-plots")
    assert r["config"]["mode"] == "open"
    assert r["preamble"]["requests"] == 2  # the calibration probes
    (lv,) = r["levels"]
    assert lv["request_rate"] == 4 and lv["completed"] == n and lv["failed"] == 0
    starts = sorted(q["start_s"] for q in lv["requests"])
    # The arrival schedule is seeded: rebuild it and check no request was sent before its turn
    # (a behaviour check; an upper bound on lateness would be a timing assertion).
    rng = random.Random(f"arrivals/{lv['seed']}")
    schedule = [0.0]
    for _ in range(n - 1):
        schedule.append(schedule[-1] + rng.gammavariate(1.0, 1.0 / 4))
    assert len(set(starts)) == n
    assert all(s >= at for s, at in zip(starts, schedule, strict=True))
    assert schedule[-1] > 0  # arrivals really are spread over time
    assert all(q["success"] and len(q["itl_ms"]) == 2 for q in lv["requests"])
    assert r["plots"] == [] and not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("dataset", ["agentic", "shared-prefix-chat"])
def test_multi_turn_workloads(server, tmp_path, dataset):
    args = (
        f"--dataset-name {dataset} --input-len 16 --prefix-len 48 --num-prefix-groups 1 "
        "--tool-result-len 24 --num-turns 2 --output-len 3 --concurrency 2 --num-prompts 4"
    )
    r = run_bench(server, tmp_path, args + " --num-warmups 0 --save-detailed --no-plots")
    (lv,) = r["levels"]
    assert r["config"]["workload"]["endpoint"] == "/v1/chat/completions"
    assert lv["num_sessions"] == 2 and lv["completed"] == 4 and lv["failed"] == 0
    by_session: dict[str, list] = {}
    for q in lv["requests"]:
        by_session.setdefault(q["session"], []).append(q)
    for reqs in by_session.values():
        assert [q["turn"] for q in reqs] == [0, 1]
        # The second turn's prompt holds the first, its reply, and a new user turn or a tool result.
        assert reqs[1]["prompt_tokens"] >= reqs[0]["prompt_tokens"] + 3 + 16
    if dataset == "agentic":
        # Every turn but the last ends in a tool call: the model's own, or a scripted one.
        assert lv["tool_calls"]["model"] + lv["tool_calls"]["scripted"] == 2


def test_failed_requests_are_counted_not_hidden(server, tmp_path):
    # Prompts longer than the model's 8192-token context: the server answers each with a 400.
    args = "--input-len 9000 --output-len 2 --concurrency 2 --num-prompts 3 --num-warmups 0"
    r = run_bench(server, tmp_path, args, expect_rc=1)
    (lv,) = r["levels"]
    assert (lv["completed"], lv["failed"]) == (0, 3)
    (group,) = lv["errors"]  # the messages differ only in the prompt's length
    assert (
        group["count"] == 3
        and group["error"].startswith("HTTP 400:")
        and "context" in group["error"]
    )
    assert lv["server"]["request_errors"] == 3
    assert lv["ttft_ms"]["p50"] is None and lv["request_throughput"] == 0
    for p in r["plots"]:  # levels without a latency still plot
        check_png(Path(p))


def test_agentic_sessions_are_deterministic():
    lengths = dict(input_len=8, prefix_len=8, tool_result_len=8, num_turns=2, output_len=4)
    cfg = WorkloadConfig(dataset="agentic", endpoint="/v1/chat/completions", **lengths)

    def transcript() -> list[dict]:
        (s,) = build_sessions(cfg, 2, seed=3, cal=TextCalibration())
        bodies = []
        while (spec := s.next_request()) is not None:
            bodies.append(spec.body)
            s.record(Response(text="ok", finish_reason="length"))
        return bodies

    a, b = transcript(), transcript()
    assert a == b and len(a) == 2
    tool_msgs = [m for m in a[1]["messages"] if m["role"] == "tool"]
    call = a[1]["messages"][-2]["tool_calls"][0]
    assert len(tool_msgs) == 1 and call["function"]["name"] in TOOL_NAMES
    assert json.loads(tool_msgs[0]["content"])["status"] == "ok"


def test_unreachable_server_exits_2(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # free once closed: nothing listens there
    rc = bench(f"--base-url http://127.0.0.1:{port} --concurrency 1 --result-dir {tmp_path}")
    assert rc == 2 and not list(tmp_path.iterdir())


def test_step_split_from_profiled_steps(server, tmp_path, capsys):
    args = "--input-len 32 --output-len 6 --concurrency 1,4 --num-prompts 4 --step-profile-every 2"
    r = run_bench(server, tmp_path, args)
    # The server's setting is back to what the bench found.
    assert httpx.get(server.url + "/telemetry/profile", timeout=10).json() == {"every": 0}
    for lv in [*r["levels"], r]:
        split = lv["step_split"]
        assert split["num_steps"] > 0 and split["step_ms_mean"] > 0
        c = split["components"]
        assert list(c) == ["attention", "mlp", "communication", "other"]
        assert c["attention"]["ms_mean"] > 0 and c["mlp"]["ms_mean"] > 0
        assert sum(x["share"] for x in c.values()) == pytest.approx(1.0)
    assert r["levels"][1]["step_split"]["batch_max"] > 1
    # The step-time model is fitted on the steps that were not profiled.
    assert r["step_fit"]["num_profiled_left_out"] > 0
    out = capsys.readouterr().out
    assert "c=1 split (" in out and "c=4 split (" in out and "sweep split (" in out
    assert r["plots"][-1] == str(tmp_path / "run-step-split.png")
    check_png(tmp_path / "run-step-split.png")
