"""DeepSeek-V4 PD decode with its own prefix cache (engines in one process, dsv4-tiny dummy
weights, CPU float32, real TCP): a turn whose prompt begins with what decode holds moves only the
rest, and decodes the tokens of a single engine; turn 1 moves what a decode without the cache
gets plus the window rows a hit at the prompt's last full page boundary reads; a page decode
caches from a transfer holds, tensor by tensor, what a page computed by a single engine holds
(compressed KV, index keys and their fp8 scales, and the window rows and compressor state at the
page end that were sent), and a page received without them never ends a match; a conversation
sharing only such pages gets a shorter hit (or none) and still answers like the single engine; a
request preempted on decode recomputes from a resumable page.

Pages hold 16 tokens and the sliding window is 16 (a resume at t reads the rows of t-15..t-1,
and the compressor state kept at the end of the page before t): a 70-token prompt's window rows
travel from token 49 on (a hit at 64 reads them; decode's own step 55..69) and the compressor
state of its page 3 only, so its pages 0..2 are cached as not resumable.
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


def _bytes_of(kinds, word: str) -> int:
    """One row of every kind named with `word` ("swa": a token's window rows; "page_prev": a
    page's compressor state at its end), every layer."""
    return sum(k.row_bytes for k in kinds if word in k.name)


def _compressed_bytes(kinds, hit: int, n: int) -> int:
    """Compressed KV and index keys completed by tokens [hit, n)."""
    return sum(
        k.row_bytes * (n // k.ratio - hit // k.ratio)
        for k in kinds
        if k.unit == PAGE and not k.keep_last
    )


def _window_only_bytes(kinds, tokens: int) -> int:
    """What a decode without the cache receives of a prompt: the window rows of its last 15
    tokens, the compressor state of its last full page, every compressed row, the state."""
    window = _bytes_of(kinds, "swa") * min(tokens, 15)
    page_end = _bytes_of(kinds, "page_prev") * (tokens // 16 - max(tokens - 16, 0) // 16)
    return window + page_end + _compressed_bytes(kinds, 0, tokens) + _state_bytes(kinds)


def _sent_bytes(kinds, hit: int, n: int) -> int:
    """What a transfer to a caching decode that holds `hit` tokens moves of an n-token prompt
    (with a full page): the window rows from max(hit, last full page boundary - 15) on, the
    compressor state of the last full page unless decode holds it, the compressed rows completed
    after `hit`, the state."""
    boundary = n // 16 * 16
    window = _bytes_of(kinds, "swa") * (n - max(hit, boundary - 15))
    page_end = _bytes_of(kinds, "page_prev") * (hit < boundary)
    return window + page_end + _compressed_bytes(kinds, hit, n) + _state_bytes(kinds)


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
        # Turn 1: all reserved before any arrived, so nothing shared; what a decode without the
        # cache receives (window rows 55..69, page 3's compressor state), plus the 6 window rows
        # 49..54 (70 mod 16: a hit at 64 reads back to 49); before the page-end state travelled
        # at all, that was 6 window rows and 1 page-end state less.
        no_cache = _window_only_bytes(kinds, TURN1)
        assert bytes1 == n * (no_cache + 6 * _bytes_of(kinds, "swa"))
        before_page_ends = no_cache - _bytes_of(kinds, "page_prev")
        assert bytes1 == n * (
            before_page_ends + 6 * _bytes_of(kinds, "swa") + _bytes_of(kinds, "page_prev")
        )
        assert bytes1 == n * _sent_bytes(kinds, 0, TURN1)
        assert bytes1 < n * (_complete_rows_bytes(kinds, TURN1) + state)  # every row: more
        # Turn 2: decode holds 80 of the 92 tokens (5 pages: turn 1's prompt received, its
        # answer computed there); only tokens 80..91's rows and the state move.
        rest = _complete_rows_bytes(kinds, TURN2) - _complete_rows_bytes(kinds, HIT)
        assert bytes2 == n * (rest + state) == n * _sent_bytes(kinds, HIT, TURN2)
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
    the same chunks: equal, bit for bit, for every per-page tensor of the pool's cache spec (which
    tests/cache/test_host_gate.py checks against a walk over the pool; not listed here: a kind
    missing from the transfer stays zero on decode),
    but the window rows and page-end state that were not sent: a page lacking those a resume
    at its end reads never ends a match.

    Turn 1 (68 tokens) is received, its window rows from token 49 on; decode computes
    its answer (to 79 tokens: 4 full pages, the 4 that prefill and the single engine cache too,
    so all three resume turn 2 at 64 and compute it in the same 22-token chunks); turn 2 (90
    tokens) is received from token 64 (window rows from 65); decode computes its answer (to 101:
    page 5 is half received, half computed there)."""
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
        prefix = pair.d.scheduler.prefix
        resumable = [prefix.node_at(ids[: 16 * (k + 1)]).resumable for k in range(6)]
        assert resumable == [False] * 3 + [True] * 3
        # A match never ends on pages 0..2 (a request resuming there would read absent rows).
        matched = [len(_pages_of(pair.d, ids[: 16 * k + 1])) for k in range(1, 7)]
        assert matched == [0, 0, 0, 4, 5, 6]
        for name, t in d_pool.items():
            window, page_end = name.endswith(".swa_kv"), "page_prev" in name
            for k, (dp, sp) in enumerate(zip(mine, theirs, strict=True)):
                a, b = t[dp], s_pool[name][sp]
                if window:  # a resume at the page end reads its rows 1..15
                    a, b = a[1:], b[1:]
                if (window or page_end) and not resumable[k]:
                    assert not torch.equal(a, b), f"{name} page {k}: rows that were never sent"
                else:
                    assert torch.equal(a, b), f"{name} page {k}"
        pair.assert_clean()


@pytest.mark.parametrize(
    "max_tokens, resumed_page",
    [
        (16, 3),  # the survivor needs 5 pages in all: the newer one's 4 stay cached
        (40, None),  # it needs 7: its growth evicts the newer one's pages 3 and 2
    ],
)
def test_a_request_preempted_on_decode_resumes_only_from_a_resumable_received_page(
    single, max_tokens: int, resumed_page: int | None
) -> None:
    """Decode's pool (9 usable pages of 16) holds two 64-token prompts but not their answers
    (the first decode step of both needs a 5th page each): the newer request is preempted, its
    4 received pages go to the cache (pages 0..2 lacking the window rows before token 49 and
    their compressor state), and it recomputes once the survivor is done. With page 3 still
    cached it resumes at 64: its state slot restored from the compressor state kept with page 3
    (received), its window from rows 49..63. With pages 3 and 2 evicted, a hit would end at
    page 1, whose rows are absent: it takes none and recomputes all. Both answers are the
    single engine's."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
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

        def restore_and_note(slot: int, page: int, end: int) -> None:
            restored.append(page)
            restore(slot, page, end)

        decode.scheduler.admit_transferred = admit_and_note
        decode.runner.cache.restore_slot = restore_and_note
        for i, ids in enumerate(prompts):
            pair.submit(f"r{i}", ids, params)
        pair.pump(lambda: all(pair.finished("decode", f"r{i}") for i in range(2)), timeout=120)
        assert decode.scheduler.num_preemptions == 1
        if resumed_page is None:
            assert restored == []  # recomputed from token 0
        else:
            assert restored == [received["r1"][resumed_page]]  # resumed at 64, a received page
        for i, w in enumerate(want):
            got = pair.outs[("decode", f"r{i}")]
            assert _tokens(got) == _tokens(w)
            lp = [x for o in got for x in o.logprobs]
            assert lp == pytest.approx([x for o in w for x in o.logprobs], abs=1e-4)
        pair.assert_clean()


def test_a_hit_that_would_end_on_a_page_lacking_window_rows_ends_earlier(single) -> None:
    """Conversations through one PD pair, one after another, sharing ever fewer pages:
    A (37 tokens: pages 0..1 of the system prompt and 5 of its own) is received with window rows
    from 17 on and page 1's compressor state, so a request can resume after page 1, not page 0;
    B (the whole 40-token system prompt + 30) hits A's pages 0..1 (32) and receives the rest,
    window rows from 49 on, so it cannot resume after its page 2; C shares B's first 50 tokens:
    its match passes pages 0..2 but ends at page 1 (32, not 48); D shares only page 0 (not
    resumable): no hit at all. Each answers like the single engine, and moves exactly what its
    hit leaves."""
    b = SYSTEM + _user(1, 1, 30)
    convs = {
        "A": (SYSTEM[:32] + _user(0, 1, 5), 0),
        "B": (b, 32),
        "C": (b[:50] + _user(2, 1, 20), 32),
        "D": (SYSTEM[:20] + _user(3, 1, 40), 0),
    }
    with pairs() as make:
        pair = make(dsv4_engine("prefill"), dsv4_engine("decode"))
        kinds, prefix = pair.d.agent.kinds, pair.d.scheduler.prefix
        for name, (ids, hit) in convs.items():
            before, hits = _sent(pair), prefix.hit_tokens
            outs = _turn(pair, [ids], name)[0]
            assert prefix.hit_tokens - hits == hit, name  # decode's (usage: prefill's, if more)
            assert _sent(pair) - before == _sent_bytes(kinds, hit, len(ids)), name
            assert _tokens(outs) == _tokens(generate(single, [ids], PARAMS)[0]), name
            if name == "B":  # what makes C's hit shorter: B's page 2 is cached lacking rows
                assert not prefix.node_at(b[:48]).resumable
                assert prefix.node_at(b[:32]).resumable
                assert not prefix.node_at(b[:16]).resumable
        pair.assert_clean()
