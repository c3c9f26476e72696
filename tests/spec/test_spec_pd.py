"""PD with a speculating decode server (`--role decode --speculative-algorithm ngram`) against
the plain shared single `server`: tool-calling-like conversations through the router give the
plain answers token for token, logprobs included, at concurrency 1 and 8, drafts are accepted on
decode (/metrics), and nothing is left in flight on either side afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from agent_turns import NUM_CONVERSATIONS, assert_same, conversation, pick, plain_turns, two_turns

sys.path.insert(0, str(Path(__file__).parents[1] / "disagg"))
from pd_stack import PDStack, metrics  # noqa: E402

ACCEPTED = "kvrelay_spec_decode_num_accepted_tokens_total"


@pytest.fixture(scope="module")
def pd():
    stack = PDStack(decode_args=("--speculative-algorithm", "ngram"))
    yield stack
    stack.close()


@pytest.mark.parametrize("convs", [list(range(NUM_CONVERSATIONS)), [1]], ids=["c8", "c1"])
def test_pd_with_speculating_decode_equals_plain_single(pd, server, convs):
    want = pick(plain_turns(server.url), convs)
    before = metrics(pd.decode.url)[ACCEPTED]
    got = two_turns(pd.router.url, [conversation(i) for i in convs], len(convs), want[: len(convs)])
    assert_same(want, got)
    assert metrics(pd.decode.url)[ACCEPTED] > before
    assert metrics(pd.prefill.url).get(ACCEPTED, 0) == 0  # prefill makes one token: no drafts
    pd.wait_idle()
