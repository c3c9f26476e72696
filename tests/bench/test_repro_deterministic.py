"""`kvrelay repro --deterministic-check` against real SmolLM2 servers: a `--deterministic`
server replays the reference's sessions at concurrency 4 with 0 divergent turns (every
divergence would count: near-tie allowance 0), and the check refuses to judge a server that is
not in the mode, or a near-tie allowance, rather than give a verdict that means nothing."""

from __future__ import annotations

import json

from conftest import SMOLLM2_DETERMINISTIC as ARGS
from test_repro import repro

SESSIONS = "--num-sessions 4 --turns 1 --max-tokens 4 --task-words 0 --system-prompt=Agent."


def test_a_deterministic_server_replays_with_no_divergence(shared_servers, tmp_path):
    s = shared_servers.get({"det": ARGS})["det"]
    out = tmp_path / "repro.json"
    rc = repro(
        f"--base-url={s.url}", "--deterministic-check", *SESSIONS.split(),
        *"--concurrency 4 --no-tools-field --tool-result-len 4 --ledger off".split(),
        "--output-json", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert rc == 0, (result["examples"], s.log())
    assert result["deterministic_servers"] == [s.url]
    assert result["config"]["near_tie"] == 0.0 and result["config"]["deterministic_check"]
    (level,) = result["levels"]
    assert level["compared"] == 4 and level["turns"] == 4
    assert level["divergent_turns"] == 0 and level["corrupted"] == 0


def test_a_server_without_the_mode_is_refused_before_any_request(server, capsys):
    before = server.metric("kvrelay_prompt_tokens_total")
    rc = repro(f"--base-url={server.url}", "--deterministic-check", *SESSIONS.split())
    assert rc == 2
    err = capsys.readouterr().err
    assert "does not run --deterministic" in err and server.url in err
    assert server.metric("kvrelay_prompt_tokens_total") == before  # nothing was sent


def test_a_near_tie_allowance_is_refused_with_the_check(capsys):
    rc = repro("--base-url=http://127.0.0.1:9", "--deterministic-check", "--near-tie", "0.1")
    assert rc == 2 and "allows no near-ties" in capsys.readouterr().err
