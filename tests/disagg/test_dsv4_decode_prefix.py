"""DeepSeek-V4 PD decode with its own prefix cache (engines in one process, dsv4-tiny dummy
weights, CPU float32, real TCP): a turn whose prompt begins with what decode holds moves only the
rest, and decodes the tokens of a single engine; a page decode caches from a transfer holds,
tensor by tensor, what a page computed by a single engine holds (window rows, compressed KV,
index keys and their fp8 scales, the compressor state at the page end); a request preempted on
decode that recomputes from received pages continues like the single engine.

Pages hold 16 tokens and the sliding window is 16: a 70-token prompt's first three pages lie
wholly outside its last window, whose rows alone a decode without the cache receives.
"""

from __future__ import annotations

import pytest
import torch
from engine_pair import dsv4_engine, pairs

from kvrelay.cache.host_gate import page_tensors
from kvrelay.disagg.layout import PAGE, SLOT
from kvrelay.engine.engine import Engine, generate
from kvrelay.engine.messages import SamplingParams

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
SYSTEM = [(13 * j) % 240 + 5 for j in range(40)]  # shared by every conversation: 2.5 pages
TURN1 = 70  # tokens: SYSTEM + 30 of the user's
# Decode computed turn 1's 70 + 11 tokens: 5 full pages (prefill's cache: the prompt's 4). Turn 2
# = 70 + 12 answer + 10 = 92.
HIT, TURN2 = 80, 92

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # two engines pumped by one thread


def _user(i: int, turn: int, n: int) -> list[int]:
    return [(7 * i + 11 * turn + 3 * j) % 240 + 7 for j in range(n)]


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def _turn(pair, prompts: list[list[int]], tag: str) -> list[list]:
    """Every prompt through PD at once; decode's outputs per prompt."""
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts, strict=True):
        pair.submit(rid, ids, PARAMS)
    pair.pump(
        lambda: all(pair.finished("decode", r) and pair.finished("prefill", r) for r in rids),
        timeout=120,
    )
    return [pair.outs[("decode", r)] for r in rids]


def _sent(pair) -> int:
    """KV bytes prefill has sent since it started."""
    return pair.p.agent.take_stats()[0].get("sent", {}).get("tcp", 0)


def _complete_rows_bytes(kinds, tokens: int) -> int:
    """Bytes of every page kind's rows that the first `tokens` tokens complete (a window row per
    token, a compressed row per `ratio` tokens, a page-end state per full page)."""
    return sum(k.row_bytes * (tokens // k.ratio) for k in kinds if k.unit == PAGE)


def _state_bytes(kinds) -> int:
    """The per-request state (compressor slot), sent once for the whole prompt."""
    return sum(k.row_bytes for k in kinds if k.unit == SLOT)


def _window_only_bytes(kinds, tokens: int) -> int:
    """What a decode without the cache receives of a prompt: the window's rows of its last
    `keep_last` tokens only, every other page kind whole."""
    total = 0
    for k in kinds:
        if k.unit == PAGE:
            total += k.row_bytes * (min(tokens, k.keep_last) if k.keep_last else tokens // k.ratio)
    return total + _state_bytes(kinds)


def _two_turns(pair, single: Engine, n: int, turn1: int = TURN1) -> tuple[int, int, list, list]:
    """n conversations, each turn's requests sent at once; turn 2 resends turn 1, its answer and
    a new user message. PD == the single engine, token for token. Returns the KV bytes each turn
    moved, turn 2's prompts and its decode outputs."""
    first = [SYSTEM + _user(i, 1, turn1 - len(SYSTEM)) for i in range(n)]
    before = _sent(pair)
    outs1 = _turn(pair, first, "t1")
    bytes1 = _sent(pair) - before
    second = [
        p + _tokens(o) + _user(i, 2, 10) for i, (p, o) in enumerate(zip(first, outs1, strict=True))
    ]
    assert {len(s) for s in second} == {turn1 + 22}
    want = generate(single, first, PARAMS), generate(single, second, PARAMS)
    outs2 = _turn(pair, second, "t2")
    bytes2 = _sent(pair) - bytes1 - before
    for got, w in zip(outs1 + outs2, want[0] + want[1], strict=True):
        assert _tokens(got) == _tokens(w)
        lp = [x for o in got for x in o.logprobs]
        assert lp == pytest.approx([x for o in w for x in o.logprobs], abs=1e-4)
    return bytes1, bytes2, second, outs2


@pytest.fixture(scope="module")
def single() -> Engine:
    return dsv4_engine("single", budget=64)


@pytest.mark.parametrize("n", [1, 8])
def test_a_second_turn_moves_only_what_decode_does_not_hold(single, n: int) -> None:
    with pairs() as make:
        pair = make(dsv4_engine("prefill"), dsv4_engine("decode"))
        assert pair.d.prefix_cache == "on"
        kinds = pair.d.agent.kinds
        bytes1, bytes2, _, outs2 = _two_turns(pair, single, n)
        state = _state_bytes(kinds)
        # Turn 1: all reserved before any arrived, so nothing shared; every row of the pages
        # (decode caches them), the state once.
        assert bytes1 == n * (_complete_rows_bytes(kinds, TURN1) + state)
        # Turn 2: decode holds 80 of the 92 tokens (5 pages: turn 1's prompt received, its
        # answer computed there); only tokens 80..91's rows and the state move.
        rest = _complete_rows_bytes(kinds, TURN2) - _complete_rows_bytes(kinds, HIT)
        assert bytes2 == n * (rest + state)
        assert pair.d.scheduler.prefix.hit_tokens == n * HIT
        assert {o[0].num_cached_tokens for o in outs2} == {HIT}  # usage: decode's hit
        pair.assert_clean()
        assert pair.d.scheduler.slot_pool.num_used == 0


def test_decode_without_prefix_cache_gets_the_whole_prompt_window_rows_last(single) -> None:
    """The measure of what the cache spares: without it turn 2 moves every compressed row of
    its 92 tokens and the window's last 15 rows (and turn 1 no older window rows either)."""
    with pairs() as make:
        pair = make(dsv4_engine("prefill"), dsv4_engine("decode", prefix_cache=False))
        assert pair.d.prefix_cache == "off (--disable-prefix-cache)"
        kinds = pair.d.agent.kinds
        bytes1, bytes2, _, _ = _two_turns(pair, single, 1)
        want = _window_only_bytes(kinds, TURN1), _window_only_bytes(kinds, TURN2)
        assert (bytes1, bytes2) == want
        pair.assert_clean()


def _pages_of(engine: Engine, tokens: list[int]) -> list[int]:
    pages, _ = engine.scheduler.prefix.match(tokens)
    return pages


@pytest.mark.parametrize("index_k", ["auto", "fp8"])
def test_a_page_received_equals_the_page_computed_by_a_single_engine(index_k: str) -> None:
    """Decode's cached pages of a two-turn conversation against a single engine's, computed in
    the same chunks: equal, bit for bit, for every per-page tensor the pool owns (found by
    walking the pool, not listed here: a kind missing from the transfer stays zero on decode).

    Turn 1 (68 tokens) is received whole; decode computes its answer (to 79 tokens: 4 full
    pages, the 4 that prefill and the single engine cache too, so all three resume turn 2 at 64
    and compute it in the same 22-token chunks); turn 2 (90 tokens) is received from token 64;
    decode computes its answer (to 101: page 5 is half received, half computed there)."""
    single = dsv4_engine("single", index_k=index_k)  # 22-token chunks, as prefill
    with pairs() as make:
        pair = make(*(dsv4_engine(role, index_k=index_k) for role in ("prefill", "decode")))
        _, _, second, outs2 = _two_turns(pair, single, 1, turn1=68)
        assert pair.d.scheduler.prefix.hit_tokens == 64
        ids = second[0] + _tokens(outs2[0])[:-1]  # every token decode computed or received
        mine, theirs = _pages_of(pair.d, ids), _pages_of(single, ids)
        assert len(mine) == len(theirs) == len(ids) // 16 == 6
        d_pool, s_pool = page_tensors(pair.d.runner.cache), page_tensors(single.runner.cache)
        assert d_pool.keys() == s_pool.keys()
        names = " ".join(d_pool)
        assert "page_prev_kv" in names and "swa" in names
        assert ("index_k_scale" in names) == (index_k == "fp8")
        for name, t in d_pool.items():
            for k, (dp, sp) in enumerate(zip(mine, theirs, strict=True)):
                assert torch.equal(t[dp], s_pool[name][sp]), f"{name} page {k}"
        pair.assert_clean()


def test_a_request_preempted_on_decode_resumes_from_received_pages_like_a_single_engine(
    single,
) -> None:
    """Decode's pool (8 usable pages of 16) holds two 64-token prompts but not their answers:
    the newer request is preempted, and the survivor's growth evicts its pages from the end
    back to the second, so it recomputes from a 32-token hit on pages it received: its state
    slot restored from the compressor state kept with page 1, its window from page 1's rows
    (which only a decode that asks for every row receives: they lie outside the prompt's last
    window). Both answers are the single engine's."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [[(5 * i + 3 * j + i * j) % 240 + 5 for j in range(64)] for i in range(2)]
    want = generate(single, prompts, params)
    with pairs() as make:
        decode = dsv4_engine("decode", max_total_tokens=144, kv_reserve_ratio=0.0)
        pair = make(dsv4_engine("prefill"), decode)
        received, restored = {}, []
        admit, restore = decode.scheduler.admit_transferred, decode.runner.cache.restore_slot

        def admit_and_note(req) -> None:  # the pages whose KV arrived, as installed
            received[req.rid] = list(req.pages)
            admit(req)

        def restore_and_note(slot: int, page: int) -> None:
            restored.append(page)
            restore(slot, page)

        decode.scheduler.admit_transferred = admit_and_note
        decode.runner.cache.restore_slot = restore_and_note
        for i, ids in enumerate(prompts):
            pair.submit(f"r{i}", ids, params)
        pair.pump(lambda: all(pair.finished("decode", f"r{i}") for i in range(2)), timeout=120)
        assert decode.scheduler.num_preemptions == 1
        assert restored == [received["r1"][1]]  # resumed at token 32, from a received page
        for i, w in enumerate(want):
            got = pair.outs[("decode", f"r{i}")]
            assert _tokens(got) == _tokens(w)
            lp = [x for o in got for x in o.logprobs]
            assert lp == pytest.approx([x for o in w for x in o.logprobs], abs=1e-4)
        pair.assert_clean()
